"""Typed job configuration: one dataclass per YAML section, validated all at once.

A job is one YAML file with the sections below. ``load_config(path, overrides)`` reads it,
applies dotted overrides (``train.lr=3e-4``), and checks every value against the schema,
collecting *all* problems (unknown keys with the nearest valid key, wrong types, values
out of range) into one :class:`ConfigError` before anything touches a cluster.
``to_dict`` / ``from_dict`` convert losslessly to the plain dicts Ray passes around.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def _f(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None, **rules: Any) -> Any:
    """A dataclass field carrying its help text and validation rules (min, max, gt, lt, choices, nonempty)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help, **rules})
    return field(default=default, metadata={"help": help, **rules})


# The metrics `raylora eval` computes (raylora.eval.metrics), in the order reports show them.
OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "kto")  # train.objective: supervised, or a preference objective
# what a preference objective's evaluations report beside eval_loss (raylora.train.preference.STATS), to sweep on
PREFERENCE_METRICS = ("eval_rewards/accuracies", "eval_rewards/margins")
METRICS = ("exact_match", "contains", "rouge-1", "rouge-2", "rouge-l", "bleu-4", "tool_name", "tool_args",
           "tool_json", "length", "reference_loss", "judge")  # fmt: skip


@dataclass
class SourceArgs:
    path: str | None = _f(
        None, help="a .json (array), .jsonl, .parquet or .csv file, a folder of them, or a glob (or give name)"
    )
    format: str = _f(
        "auto",
        help="row format; auto detects it from the first row",
        choices=("auto", "alpaca", "sharegpt", "openai", "text"),
    )
    weight: float = _f(
        1.0, help="row multiplier when mixing: 0.5 keeps a seeded half of the rows, 2 repeats each twice", gt=0
    )
    columns: dict[str, str] = _f(
        help="format field or sharegpt tag -> this file's name, e.g. {output: response, user_tag: user, tools: functions}",
        factory=dict,
    )
    name: str | None = _f(None, help="a dataset of data.dataset_info, instead of a path")


@dataclass
class DataArgs:
    sources: list[SourceArgs] = _f(help="datasets to read and mix", factory=list)
    dataset_info: str | None = _f(
        None, help="a LLaMA-Factory dataset_info.json; data.sources[].name picks its datasets (file_name beside it)"
    )
    template: str = _f(
        "auto",
        help="chat template: the tokenizer's own (auto; chatml if it has none) or a named fallback",
        choices=("auto", "chatml", "alpaca"),
    )
    cutoff_len: int = _f(1024, help="maximum tokens per example (and per pack)", min=8)
    truncation: str = _f(
        "tail", help="an example over cutoff_len: tail cuts its end; reject rejects it", choices=("tail", "reject")
    )
    packing: bool = _f(True, help="pack several examples into each sequence (block-diagonal attention)")
    train_on_prompt: bool = _f(False, help="learn prompt tokens too, not only the assistant turns")
    mask_history: bool = _f(
        False, help="learn only each row's last assistant turn (a row's own mask_history field overrides this)"
    )
    drop_reasoning: bool = _f(False, help="leave reasoning parts out instead of rendering them before the answer")
    eval_fraction: float = _f(0.0, help="fraction of rows held out for evaluation", min=0.0, lt=1.0)
    eval_count: int | None = _f(None, help="number of rows held out for evaluation (instead of eval_fraction)", min=1)
    seed: int = _f(42, help="seed of the train/eval split and of weight sampling")
    max_samples: int | None = _f(None, help="read at most this many rows of each file (None: all)", min=1)
    placeholders: dict[str, str] = _f(help="values for {{key}} placeholders in the data", factory=dict)
    max_reject_fraction: float = _f(
        0.05, help="fail the run when more than this fraction of rows is rejected", min=0.0, max=1.0
    )
    output_dir: str = _f(
        "outputs/data", help="where prepare writes shards, manifest, rejects and summary", nonempty=True
    )
    streaming: bool = _f(
        False,
        help="training runs the pipeline on the raw files as it reads them, writing no shards "
        "(rejects and summary go to train.output_dir/data)",
    )


@dataclass
class ModelArgs:
    name_or_path: str = _f(
        "smollm2-135m-instruct",
        help="registry name, Hugging Face model folder, or .gguf file",
        nonempty=True,
    )
    dtype: str = _f("float32", help="dtype of the base weights", choices=("float32", "bfloat16", "float16"))
    cache_dir: str | None = _f(
        None, help="where converted models are cached (None: $RAYLORA_CACHE or ~/.cache/raylora)"
    )


@dataclass
class LoraArgs:
    rank: int = _f(8, help="LoRA rank r", min=1, max=1024)
    alpha: float = _f(16.0, help="LoRA alpha (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA)", gt=0)
    dropout: float = _f(0.05, help="dropout on the LoRA input", min=0.0, lt=1.0)
    target_modules: list[str] = _f(
        help="module names, or presets attention / mlp / all-linear", factory=lambda: ["attention"], nonempty=True
    )
    use_rslora: bool = _f(False, help="rank-stabilised scaling alpha / sqrt(r)")
    use_dora: bool = _f(False, help="weight-decomposed LoRA (DoRA)")


@dataclass
class TrainArgs:
    output_dir: str = _f(
        "outputs/run", help="folder for the adapter, resolved config, loss plot and Ray's checkpoints", nonempty=True
    )
    max_steps: int = _f(10, help="optimizer steps", min=1)
    batch_size: int = _f(2, help="packed sequences per micro-batch per worker", min=1)
    grad_accum: int = _f(
        1, help="micro-batches per optimizer step; all but the last skip the all-reduce (no_sync)", min=1
    )
    lr: float = _f(2e-4, help="peak learning rate", gt=0, max=1.0)
    lr_mlp_scale: float = _f(1.0, help="learning-rate multiplier for LoRA weights on MLP layers (attention: 1)", gt=0)
    scheduler: str = _f("cosine", help="learning-rate decay after warm-up", choices=("cosine", "linear", "constant"))
    warmup_steps: int = _f(0, help="linear warm-up steps", min=0)
    weight_decay: float = _f(0.0, help="AdamW weight decay", min=0.0)
    adam_eps: float = _f(1e-8, help="AdamW epsilon (raised to 1e-6 under fp16)", gt=0)
    max_grad_norm: float = _f(1.0, help="gradient clipping norm (0 disables)", min=0.0)
    seed: int = _f(42, help="random seed: LoRA init, dropout and each epoch's order of the packs")
    num_workers: int = _f(1, help="Ray Train workers (one per device)", min=1)
    cpus_per_worker: float | None = _f(
        None,
        help="CPUs Ray reserves per worker, and its torch threads (unset: a training job's workers share the CPUs the "
        "cluster has free; a sweep's trials take 1 each)",
        gt=0,
    )
    log_every: int = _f(1, help="steps between progress lines and MLflow metrics", min=1)
    eval_every: int = _f(0, help="steps between evaluations (0: only at the end)", min=0)
    checkpoint_every: int = _f(0, help="steps between checkpoints (0: only at the end)", min=0)
    generate_eval_every: int = _f(
        0,
        help="steps between generation evals during training (and at the end): rank 0 answers train.generate_eval_rows "
        "rows of the eval set (eval.sources, else the held-out split) with the adapter so far, logged as "
        "gen_<metric> for each of eval.metrics but reference_loss and judge (0: none)",
        min=0,
    )
    generate_eval_rows: int = _f(16, help="rows of the eval set a generation eval answers", min=1)
    keep_checkpoints: int = _f(2, help="checkpoints kept (the newest)", min=1)
    max_failures: int = _f(2, help="worker-group restarts from the last checkpoint before the run fails", min=0)
    nan_tolerance: int = _f(5, help="non-finite steps in a row before rolling back to the last good checkpoint", min=1)
    comm_hook: str = _f(
        "none",
        help="gradient all-reduce: none (fp32), fp16 / bf16 (cast on the wire), powersgd (low rank, error feedback), "
        "topk (largest entries with error feedback), sign (1 bit an entry and a scale per tensor, error feedback), "
        "hadamard3 (3 bits an entry after a random Hadamard rotation of each 128-entry block, error feedback: "
        "0.098 of the bytes)",
        choices=("none", "fp16", "bf16", "powersgd", "topk", "sign", "hadamard3"),
    )
    topk_fraction: float = _f(0.01, help="share of each gradient bucket the topk hook sends", gt=0, max=1)
    powersgd_rank: int = _f(1, help="rank of PowerSGD's low-rank approximation", min=1)
    powersgd_warmup: int = _f(
        2, help="steps of plain all-reduce before PowerSGD compresses (PyTorch needs at least 2)", min=2
    )
    bucket_mb: float = _f(25.0, help="DDP gradient bucket size in MiB (LoRA's gradients fit one bucket)", gt=0)
    fused_lora: bool = _f(True, help="fused LoRA linear: one down-projection for q/k/v and for gate/up, scaling in B")
    chunked_loss: bool = _f(
        True, help="score only label positions through the LM head, a chunk at a time (full logits never held)"
    )
    recompute_every: int = _f(
        0, help="recompute the activations of every N-th decoder layer in the backward (0: off; 1: all layers)", min=0
    )
    compile: bool = _f(False, help="torch.compile each decoder layer (inductor on CPU/CUDA, TorchAir on NPU)")
    profile: bool = _f(
        False, help="profile steps 3-5 on rank 0: trace and top-operators table in output_dir/profile and MLflow"
    )
    objective: str = _f(
        "sft",
        help="what the adapter learns: sft (the answers), or a preference objective on chosen / rejected answers: "
        "dpo (against the base with the adapter off), simpo or orpo (no reference), or kto on answers labelled "
        "desirable or not (against the base); settings in preference.*",
        choices=OBJECTIVES,
    )


@dataclass
class PreferenceArgs:
    beta: float = _f(
        0.1, help="dpo and kto: strength of the pull away from the reference; simpo: reward scale (SimPO's paper: "
        "2-2.5); orpo: weight of the odds-ratio term (ORPO's lambda)", gt=0,
    )  # fmt: skip
    loss_type: str = _f(
        "sigmoid", help="dpo's loss: sigmoid (DPO) or ipo (squared, on length-averaged log-probabilities)",
        choices=("sigmoid", "ipo"),
    )  # fmt: skip
    label_smoothing: float = _f(
        0.0, help="dpo (sigmoid) and simpo: assumed share of pairs whose labels are flipped (conservative DPO)",
        min=0.0, lt=0.5,
    )  # fmt: skip
    gamma: float = _f(0.5, help="simpo: target reward margin over beta (TRL's simpo_gamma)", min=0.0)
    sft_weight: float = _f(
        0.0, help="dpo: weight of the chosen answers' cross-entropy per token added to the loss (RPO; TRL's "
        "loss_type [sigmoid, sft] with loss_weights [1, w]): anchors the chosen answers' likelihood", min=0.0,
    )  # fmt: skip
    desirable_weight: float = _f(
        1.0, help="kto: weight of the desirable answers' losses (KTO's paper: keep desirable_weight x their count "
        "over undesirable_weight x theirs in [1, 4/3])", gt=0,
    )  # fmt: skip
    undesirable_weight: float = _f(1.0, help="kto: weight of the undesirable answers' losses", gt=0)


@dataclass
class TuneArgs:
    space: dict[str, Any] = _f(
        help="search space: a lora.*, train.* or preference.* key -> one distribution: {choice: [v, ...]}, {grid: [v, ...]}, "
        "{uniform: [low, high]}, {loguniform: [low, high]}, {randint: [low, high]} (high excluded)",
        factory=dict,
    )
    search: str = _f(
        "random",
        help="random: sample each trial; grid: every combination of grid/choice values; optuna: TPE (needs optuna)",
        choices=("random", "grid", "optuna"),
    )
    scheduler: str = _f(
        "asha",
        help="asha stops trials whose metric lags at each rung of steps; none runs every trial to train.max_steps",
        choices=("asha", "none"),
    )
    num_samples: int = _f(4, help="trials to run (with search: grid, passes over the whole grid)", min=1)
    metric: str = _f(
        "eval_loss",
        help="metric to optimise: as training reports it (eval_* every train.eval_every steps; loss every log_every), "
        "or a metric of raylora eval (exact_match, rouge-l, ...: ASHA then stops trials on eval_loss, and the best "
        "completed trial is the one whose answers to the eval set score best)",
        choices=("eval_loss", "eval_perplexity", "loss", *PREFERENCE_METRICS, *(m for m in METRICS if m != "length")),
    )
    mode: str = _f("min", help="optimisation direction", choices=("min", "max"))
    max_concurrent: int | None = _f(
        None, help="trials run at once (None: as many as the cluster's CPUs / GPUs / NPUs fit)", min=1
    )
    grace_steps: int | None = _f(
        None, help="steps every trial runs before ASHA may stop it (None: train.eval_every)", min=1
    )
    reduction_factor: int = _f(2, help="ASHA keeps 1 / reduction_factor of the trials at each rung", min=2)
    trials_per_group: int = _f(
        1,
        help="trials trained together on one shared copy of the base model (one forward over all their rows, "
        "each trial its own adapter, optimizer and data position); 1: each trial is its own Ray Train run",
        min=1,
    )
    generate_at_rungs: bool = _f(
        False,
        help="with a generation metric: each trial answers train.generate_eval_rows of the eval set at every multiple "
        "of ASHA's first rung (train.generate_eval_every is set to it), and ASHA compares trials on that score "
        "(gen_<metric>) instead of eval_loss; the best completed trial is still chosen on the whole eval set",
    )
    register_as: str | None = _f(
        None, help="MLflow registered model name of the best adapter (None: the name of train.output_dir's folder)"
    )

    @property
    def answers(self) -> bool:
        """Whether the best trial is chosen on its answers (``metric`` is a generation metric of raylora eval)."""
        return self.metric in METRICS

    @property
    def rung_metric(self) -> str:
        """What trials report to Tune and ASHA compares at its rungs: ``metric``; for a generation one, eval_loss, or
        its score on a few eval rows (``gen_<metric>``) with ``generate_at_rungs``."""
        if not self.answers:
            return self.metric
        return f"gen_{self.metric}" if self.generate_at_rungs else "eval_loss"

    @property
    def rung_mode(self) -> str:
        return "min" if self.answers and not self.generate_at_rungs else self.mode


@dataclass
class ServeArgs:
    engine: str = _f(
        "hf",
        help="hf: transformers + peft (every device); vllm: Ray Serve LLM on vLLM (CUDA) or vllm-ascend (NPU)",
        choices=("hf", "vllm"),
    )
    host: str = _f("127.0.0.1", help="address the HTTP server binds to", nonempty=True)
    port: int = _f(8000, help="HTTP port", min=1, max=65535)
    replicas: int = _f(1, help="model replicas (each holds the base model and its own adapter LRU)", min=1)
    cpus_per_replica: float = _f(1.0, help="CPUs Ray reserves for each model replica", gt=0)
    adapter_root: str = _f("outputs/adapters", help="folder of servable adapters, one sub-folder per adapter name")
    max_adapters: int = _f(8, help="adapters kept loaded per replica (LRU)", min=1)
    max_lora_rank: int = _f(64, help="largest adapter rank accepted", min=1)
    adapter_bits: int = _f(
        16, help="adapter weights in memory: 16 (as saved) or 4 (int4, groups of adapter_group_size)", choices=(16, 4)
    )
    adapter_group_size: int = _f(128, help="weights sharing one scale when adapter_bits is 4", min=8)
    quantization: str = _f("none", help="base model quantisation", choices=("none", "w8a8", "w8a8-smoothquant"))
    smoothquant_alpha: float = _f(0.5, help="SmoothQuant migration strength (0: none to weights, 1: all)", min=0, max=1)
    calibration_rows: int = _f(32, help="rows of data.sources used to calibrate SmoothQuant", min=1)
    max_batch_size: int = _f(16, help="sequences decoded together per replica", min=1)
    engine_threads: int | None = _f(
        None,
        help="torch intra-op threads of the replica's generation thread (None: round(cpus_per_replica))",
        min=1,
    )
    batch_wait_ms: float = _f(5.0, help="how long a new batch waits for more requests to arrive", min=0)
    max_prefill_tokens: int = _f(
        64,
        help="prompt tokens prefilled between two decode steps: a long prompt is prefilled in chunks of this size, "
        "so it delays the running streams by one chunk at a time, not by its whole prefill; shorter prompts waiting "
        "together are prefilled as one batch of up to max_batch_size times this",
        min=1,
    )
    max_prompt_tokens: int | None = _f(
        None, help="longest prompt accepted, in tokens (None: the model's context); longer ones get 400", min=1
    )
    prefix_cache_mb: float = _f(
        64.0,
        help="keys and values of prompts' first tokens kept per replica, per adapter, for later requests that start "
        "the same way (blocks of 16 tokens, least recently used out first; 0: off)",
        min=0,
    )
    max_tokens: int = _f(
        256, help="generated tokens when a request gives no max_tokens (fewer if the context has less room)", min=1
    )
    max_schema_chars: int = _f(
        32768, help="longest response_format JSON schema accepted, in characters of JSON; longer ones get 400", min=2
    )
    api_key: str | None = _f(None, help="bearer key every request needs (None: env RAYLORA_API_KEY, else open)")
    admin_key: str | None = _f(
        None, help="bearer key for POST /v1/adapters (None: env RAYLORA_ADMIN_KEY, else registration is off)"
    )


# What only serve.engine=hf reads; serve.engine=vllm refuses each one set to anything but its default.
HF_ENGINE_KEYS = ("engine_threads", "batch_wait_ms", "max_prefill_tokens", "max_prompt_tokens", "adapter_group_size",
                  "smoothquant_alpha", "calibration_rows", "max_schema_chars", "prefix_cache_mb")  # fmt: skip


@dataclass
class ExportArgs:
    adapter: str | None = _f(None, help="adapter folder merged into the base (None: the base alone)")
    quantization: str = _f(
        "none",
        help="none writes a merged Hugging Face folder; w8a8 / w8a8-smoothquant (serve.smoothquant_alpha, "
        "serve.calibration_rows) write raylora's int8 folder",
        choices=("none", "w8a8", "w8a8-smoothquant"),
    )
    output_dir: str = _f("outputs/export", help="folder written; it must not exist yet", nonempty=True)


@dataclass
class JudgeArgs:
    url: str | None = _f(
        None,
        help="an OpenAI-compatible endpoint (its /v1 base URL, raylora serve's included) that scores each answer "
        "(None: no judge)",
    )
    model: str = _f("judge", help="the judge's model name, as the endpoint lists it", nonempty=True)
    prompt: str = _f(
        "Score how well the answer matches the reference answer to the question, from 0 (wrong or unrelated) to 10 "
        "(as good as the reference). Reply with the number only.\n\nQuestion: {question}\n\nReference answer: "
        "{reference}\n\nAnswer: {answer}",
        help="the judge's prompt, with {question}, {reference} and {answer}; the first number of its reply, 0-10, is "
        "the row's judge score (shown over 10)",
        nonempty=True,
    )
    api_key_env: str | None = _f(None, help="environment variable holding the endpoint's bearer key (None: no key)")
    max_tokens: int = _f(8, help="tokens the judge may write", min=1)
    retries: int = _f(2, help="retries of a failed request before its row is left unjudged (counted)", min=0)
    timeout_s: float = _f(60.0, help="seconds to wait for one judgement", gt=0)
    concurrency: int = _f(8, help="judgements in flight at once", min=1)


@dataclass
class EvalArgs:
    candidates: list[str] = _f(
        help="what answers: base (the base model), adapter folders, models:/NAME/VERSION (MLflow registry), or a "
        "sweep's output folder (every completed trial)",
        factory=lambda: ["base"],
        nonempty=True,
    )
    sources: list[SourceArgs] = _f(
        help="the eval set, in any format data.sources takes (empty: the held-out split of data.sources); the "
        "reference is each row's last assistant turn, or its tool calls",
        factory=list,
    )
    max_rows: int | None = _f(None, help="score at most this many rows of the eval set (None: all)", min=1)
    max_tokens: int = _f(64, help="generated tokens per answer at most", min=1)
    temperature: float = _f(0.0, help="sampling temperature (0: greedy)", min=0.0)
    top_p: float = _f(1.0, help="nucleus sampling mass", gt=0.0, max=1.0)
    stop: list[str] = _f(help="strings that end an answer", factory=list)
    seed: int = _f(0, help="sampling seed of each answer (with temperature > 0)")
    metrics: list[str] = _f(
        help="scores per candidate: exact_match, contains, rouge-1, rouge-2, rouge-l, bleu-4 (as LLaMA-Factory's "
        "predict reports them), tool_name, tool_args, tool_json, length, reference_loss (cross-entropy per token of "
        "the reference answer), judge (eval.judge's score, 0-10)",
        factory=lambda: list(METRICS),
        nonempty=True,
    )
    keys: list[str] = _f(
        help="key strings: a row's keys are those its reference contains, and 'contains' scores answers holding "
        "all of them (with key_pattern)",
        factory=list,
    )
    key_pattern: str | None = _f(None, help="a regular expression: its matches in a row's reference are keys too")
    actors_per_node: int = _f(1, help="generation actors per Ray node, each holding one copy of the base", min=1)
    cpus_per_actor: float = _f(1.0, help="CPUs each generation actor takes (and its torch threads)", gt=0)
    batch_rows: int = _f(
        64,
        help="rows handed to an actor at once (two batches in flight per actor; its engine decodes "
        "eval.max_batch_size rows together)",
        min=1,
    )
    max_batch_size: int = _f(
        64,
        help="sequences an actor's engine decodes together: more than serving's, since an eval waits for its "
        "throughput, not for each answer",
        min=1,
    )
    judge: JudgeArgs = _f(help="a model scoring each answer against its reference (optional)", factory=JudgeArgs)
    output_dir: str = _f("outputs/eval", help="where answers.jsonl, rejects.jsonl, report.md/.json and the chart go",
                         nonempty=True)  # fmt: skip


@dataclass
class TrackingArgs:
    enabled: bool = _f(True, help="log to MLflow")
    uri: str | None = _f(None, help="MLflow tracking URI (None: sqlite file mlflow.db in the working folder)")
    experiment: str = _f("raylora", help="MLflow experiment name", nonempty=True)


@dataclass
class HcclArgs:
    connect_timeout: int = _f(1800, help="HCCL_CONNECT_TIMEOUT seconds", min=120, max=7200)
    exec_timeout: int | None = _f(
        None,
        help="HCCL_EXEC_TIMEOUT seconds (None: CANN default; Atlas A2/A3: 0 = never, up to 2147483647; 910A and "
        "310P: 1-17340, rounded down to a multiple of 68, checked where the worker sees its SoC)",
        min=0,
        max=2147483647,
    )
    buffsize: int | None = _f(None, help="HCCL_BUFFSIZE MB per communicator (None: CANN default 200)", min=1)
    if_ip: str | None = _f(None, help="HCCL_IF_IP: this host's NIC address for HCCL (differs per host)")
    socket_ifname: str | None = _f(
        None,
        help="HCCL_SOCKET_IFNAME: NIC name prefixes for HCCL (enp,eno; =enp3s0 exact; ^ excludes); None: HCCL picks",
    )


@dataclass
class BackendArgs:
    device: str = _f(
        "auto", help="device type; auto probes npu, then cuda, then cpu", choices=("auto", "npu", "cuda", "cpu")
    )
    precision: str = _f(
        "auto",
        help="autocast dtype; auto picks bf16 where the device runs it fast (probed), else fp32 (fp16 + scaler on 910A/310P, older CUDA)",
        choices=("auto", "fp32", "bf16", "fp16"),
    )
    hccl: HcclArgs = _f(help="HCCL, the NPU collectives", factory=HcclArgs)


@dataclass
class JobConfig:
    data: DataArgs = _f(help="preprocessing", factory=DataArgs)
    model: ModelArgs = _f(help="base model", factory=ModelArgs)
    lora: LoraArgs = _f(help="adapter", factory=LoraArgs)
    train: TrainArgs = _f(help="training", factory=TrainArgs)
    preference: PreferenceArgs = _f(help="preference objectives (train.objective)", factory=PreferenceArgs)
    tune: TuneArgs = _f(help="sweeps", factory=TuneArgs)
    serve: ServeArgs = _f(help="serving", factory=ServeArgs)
    export: ExportArgs = _f(help="merged or quantised model folders", factory=ExportArgs)
    eval: EvalArgs = _f(help="answers scored against references (raylora eval)", factory=EvalArgs)
    tracking: TrackingArgs = _f(help="MLflow", factory=TrackingArgs)
    backend: BackendArgs = _f(help="device", factory=BackendArgs)


class ConfigError(ValueError):
    """Every problem found in a configuration, each as ``(dotted.path, message)``."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config"):
        self.problems = problems
        lines = [f"{source} has {len(problems)} problem{'s' if len(problems) != 1 else ''}:"]
        lines += [f"  - {path}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML job file, apply dotted overrides and validate everything.

    Args:
        path: YAML file; ``None`` starts from the defaults.
        overrides: ``["train.lr=3e-4", "lora.target_modules=[q_proj,v_proj]"]``; values are parsed as YAML.
    Returns:
        The validated :class:`JobConfig`.
    Raises:
        ConfigError: listing every problem of the file and the overrides together.
    """
    source = str(path) if path is not None else "config"
    raw: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                [("<file>", f"{p} does not exist; pass the path of a YAML job file (see configs/)")], source
            )
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError([("<file>", f"is not valid YAML: {e}")], source) from None
    if not isinstance(raw, dict):
        raise ConfigError([("<file>", f"must hold a mapping of sections, got {type(raw).__name__}")], source)
    problems: list[tuple[str, str]] = []
    for item in overrides or []:
        _apply_override(raw, item, problems)
    cfg = _build(JobConfig, raw, "", problems)
    _check_sources(cfg.data, problems)
    if not problems:
        _check_relations(cfg, problems)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def from_dict(data: dict[str, Any]) -> JobConfig:
    """Validate a plain dict (as produced by :func:`to_dict`) into a :class:`JobConfig`."""
    problems: list[tuple[str, str]] = []
    cfg = _build(JobConfig, data, "", problems)
    _check_sources(cfg.data, problems)
    if not problems:
        _check_relations(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain, YAML- and JSON-serialisable dict of a config section or the whole job."""
    return dataclasses.asdict(cfg)


SECRETS = (("serve", "api_key"), ("serve", "admin_key"))
REDACTED = "<redacted>"


def to_record(cfg: JobConfig) -> dict[str, Any]:
    """:func:`to_dict` of the job for what is written or logged (config.yaml, MLflow params, export manifests):
    the keys in :data:`SECRETS` that are set read ``<redacted>``."""
    record = to_dict(cfg)
    for section, key in SECRETS:
        if record[section][key] is not None:
            record[section][key] = REDACTED
    return record


def _apply_override(raw: dict[str, Any], item: str, problems: list[tuple[str, str]]) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        problems.append((item, "an override must look like section.key=value, e.g. train.lr=3e-4"))
        return
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        if text.strip().startswith(("[", "{")):  # a list or mapping gone wrong, not a string
            problems.append(
                (
                    key,
                    f"{text!r} is not valid YAML ({str(e).splitlines()[0]}); e.g. {key}=[a,b], or quote a string: "
                    f"{key}='{text}'",
                )
            )
            return
        value = text
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts):
        slot: str | int = part
        if isinstance(node, list):  # an entry of a list, by index: data.sources.0.path=...
            if not (part.isdigit() and int(part) < len(node)):
                where = ".".join(parts[:i])
                entries = f"indexes 0-{len(node) - 1}" if node else "no entries"
                problems.append((key, f"{where} is a list with {entries}; {part!r} is not one of them"))
                return
            slot = int(part)
        if i == len(parts) - 1:
            node[slot] = value
            return
        child = node[slot] if isinstance(slot, int) else node.get(slot)
        if not isinstance(child, dict | list):
            child = {}
            node[slot] = child
        node = child


def _build(cls: type, data: Any, path: str, problems: list[tuple[str, str]]) -> Any:
    if not isinstance(data, dict):
        problems.append((path or "<root>", f"expected a mapping for {cls.__name__}, got {_show(data)}"))
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = _join(path, str(key))
            problems.append((where, _unknown(str(key), list(fields), where)))
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            value = coerce(data[name], hints[name], _join(path, name), problems)
            if value is not _BAD:
                _check_rules(value, f.metadata, _join(path, name), problems)
                kwargs[name] = value
        elif f.metadata.get("nonempty") and f.default is not dataclasses.MISSING and not f.default:
            problems.append((_join(path, name), f"is required ({f.metadata['help']})"))
    return cls(**kwargs)


_BAD = object()


def coerce(value: Any, tp: Any, path: str, problems: list[tuple[str, str]]) -> Any:
    """``value`` as type ``tp`` by the config's rules (``1e-3`` read as a float, a list's items each); a value that
    cannot be appends ``(path, why)`` to ``problems`` and returns ``_BAD``."""
    if tp is Any:  # checked by the section's own validation (tune.space: raylora.tune.space)
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(value, inner, path, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if origin is list:
        (item_tp,) = args
        if isinstance(value, str) and item_tp is str:
            value = [value]
        if not isinstance(value, list):
            problems.append((path, f"got {_show(value)}, expected a list of {_name(item_tp)}"))
            return _BAD
        items = [coerce(v, item_tp, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return _BAD if any(i is _BAD for i in items) else items
    if origin is dict:
        if not isinstance(value, dict):
            problems.append((path, f"got {_show(value)}, expected a mapping of {_name(args[0])} to {_name(args[1])}"))
            return _BAD
        return {str(k): coerce(v, args[1], f"{path}.{k}", problems) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    problems.append((path, f"got {_show(value)}, expected {_name(tp)}"))
    return _BAD


def _check_rules(value: Any, rules: Any, path: str, problems: list[tuple[str, str]]) -> None:
    if value is None:
        return
    if rules.get("nonempty") and not value:
        problems.append((path, f"must not be empty ({rules['help']})"))
    if "choices" in rules and value not in rules["choices"]:
        allowed = ", ".join(map(str, rules["choices"]))
        near = [_VALUES_KNOWN_AS[value]] if _VALUES_KNOWN_AS.get(value) in rules["choices"] else []
        near = near or difflib.get_close_matches(str(value), list(map(str, rules["choices"])), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        problems.append((path, f"got {value!r}, allowed: {allowed}{hint}"))
    bounds = [("min", lambda v, b: v >= b, "≥"), ("max", lambda v, b: v <= b, "≤"),
              ("gt", lambda v, b: v > b, ">"), ("lt", lambda v, b: v < b, "<")]  # fmt: skip
    values = value if isinstance(value, list) else [value]
    for key, ok, _ in bounds:
        if key in rules and any(isinstance(v, (int, float)) and not ok(v, rules[key]) for v in values):
            allowed = " and ".join(f"{s} {rules[k]}" for k, _, s in bounds if k in rules)
            problems.append((path, f"got {value!r}, allowed: {allowed}"))
            break


def _check_relations(cfg: JobConfig, problems: list[tuple[str, str]]) -> None:
    if cfg.data.eval_fraction > 0 and cfg.data.eval_count is not None:
        problems.append(("data.eval_count", "set either data.eval_fraction or data.eval_count, not both"))
    for section, key in SECRETS:
        if getattr(getattr(cfg, section), key) == REDACTED:
            problems.append((f"{section}.{key}", f"is {REDACTED!r}, what a written config holds in place of the key; "
                                                 "set the key here or in the environment (RAYLORA_API_KEY, RAYLORA_ADMIN_KEY)"))  # fmt: skip
    if cfg.train.warmup_steps >= cfg.train.max_steps > 0:
        problems.append((
            "train.warmup_steps",
            f"{cfg.train.warmup_steps} is not below train.max_steps={cfg.train.max_steps}: warm-up would take the "
            "whole run, so the learning rate would never decay from train.lr (nor reach it, past max_steps)",
        ))  # fmt: skip


def _check_sources(data: DataArgs, problems: list[tuple[str, str]]) -> None:
    """Each source gives a path or a registry name (checked beside the type errors: it is one of them to a user)."""
    for k, source in enumerate(data.sources):
        where = f"data.sources[{k}]"
        if source.path is None and source.name is None:
            problems.append(
                (f"{where}.path", "is required: a data file, folder or glob (or a name from data.dataset_info)")
            )
        elif source.path is not None and source.name is not None:
            problems.append((where, f"give path or name, not both (path {source.path!r}, name {source.name!r})"))
        elif source.path is not None and not source.path:
            problems.append((f"{where}.path", "must not be empty (a data file, folder or glob)"))
        elif source.name is not None and data.dataset_info is None:
            problems.append(
                (
                    f"{where}.name",
                    f"names dataset {source.name!r}, but data.dataset_info (the registry file) is not set",
                )
            )


# Other names of allowed values (difflib finds 'npu' nearest to 'gpu')
_VALUES_KNOWN_AS = {"gpu": "cuda", "ascend": "npu", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# What Hugging Face Trainer, peft and LLaMA-Factory call our keys (a typo's nearest spelling misses these).
_KNOWN_AS = {
    "learning_rate": "lr", "gradient_accumulation_steps": "grad_accum", "per_device_train_batch_size": "batch_size",
    "lr_scheduler_type": "scheduler", "logging_steps": "log_every", "eval_steps": "eval_every",
    "save_steps": "checkpoint_every", "save_total_limit": "keep_checkpoints", "gradient_checkpointing": "recompute_every",
    "lora_rank": "rank", "r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "lora_target": "target_modules",
    "model_name_or_path": "name_or_path", "val_size": "eval_fraction", "dataset": "sources", "lr_rate": "lr",
}  # fmt: skip


# Keys renamed since a release: the old name is refused with the new one.
_RENAMED = {f"backend.hccl_{k}": f"backend.hccl.{k}" for k in ("connect_timeout", "exec_timeout", "buffsize", "if_ip",
                                                                 "socket_ifname")}  # fmt: skip


def _unknown(key: str, valid: list[str], path: str) -> str:
    if path in _RENAMED:
        return f"renamed: write {_RENAMED[path]} instead"
    near = [_KNOWN_AS[key]] if _KNOWN_AS.get(key) in valid else difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return f"unknown key; {hint}valid keys: {', '.join(valid)}"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def reference_markdown() -> str:
    """The config reference table of docs/config.md, generated from the schema."""
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, key, rules = hints[f.name], f"{prefix}{f.name}", f.metadata
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{key}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            signs = (("min", "≥"), ("gt", ">"), ("max", "≤"), ("lt", "<"))
            allowed = ", ".join(map(str, rules["choices"])) if "choices" in rules else ""
            allowed = allowed or " and ".join(f"{sign} {rules[k]}" for k, sign in signs if k in rules)
            name = str(tp).replace("typing.", "").replace("raylora.config.", "").replace("<class '", "")
            name = name.replace("'>", "").replace("|", "\\|")
            rows.append(f"| `{key}` | {name} | `{_yaml_value(default)}` | {allowed} | {rules['help']} |")
            item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
            if dataclasses.is_dataclass(item):
                walk(item, f"{key}[].")

    walk(JobConfig, "")
    return "\n".join(rows)


def _yaml_value(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
