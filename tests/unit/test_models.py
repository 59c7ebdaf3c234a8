import json

import numpy as np
import pytest
import torch
from peft import PeftModel

from raylora.config import LoraArgs, ModelArgs, load_config
from raylora.model_files import ModelError, tiny_tokenizer
from raylora.models import attach_lora, load_model, randomise_lora, target_modules, tiny_model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_tiny_models_are_small_and_deterministic(name):
    model, tokenizer = load_model(ModelArgs(name_or_path=name))
    again, _ = load_model(ModelArgs(name_or_path=name))
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.model_type == name.removeprefix("tiny-")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    assert tokenizer.pad_token is not None


def test_tiny_tokenizer_round_trips_text_and_renders_chatml():
    tok = tiny_tokenizer()
    text = "héllo 你好\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id


@pytest.mark.parametrize(
    "lora",
    [
        LoraArgs(rank=4, target_modules=["attention"]),
        LoraArgs(rank=8, target_modules=["attention", "mlp"], use_rslora=True, dropout=0.0),
        LoraArgs(rank=4, target_modules=["q_proj", "down_proj"], use_dora=True),
        LoraArgs(rank=2, target_modules=["all-linear"]),
    ],
    ids=["attention", "rslora-all", "dora", "all-linear"],
)
def test_saved_adapter_reloads_in_peft_with_the_same_logits(tmp_path, lora):
    model = attach_lora(tiny_model("llama"), lora)
    randomise_lora(model, seed=1, scale=0.1)
    model.eval()
    ids = torch.tensor([[1, 5, 9, 40, 77, 3]])
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert not torch.allclose(ours, base, atol=1e-4)  # the adapter really changes the output
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == lora.rank and saved["use_rslora"] == lora.use_rslora and saved["use_dora"] == lora.use_dora

    reloaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = reloaded(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=0)


def test_presets_expand_to_module_names():
    model = tiny_model("qwen2")
    assert target_modules(model, ["attention"]) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert target_modules(model, ["mlp", "q_proj"]) == ["gate_proj", "up_proj", "down_proj", "q_proj"]
    assert target_modules(model, ["all-linear"]) == "all-linear"
    lora = attach_lora(model, LoraArgs(target_modules=["mlp"]))
    assert sorted(lora.peft_config["default"].target_modules) == ["down_proj", "gate_proj", "up_proj"]
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_unknown_target_module_names_the_real_ones():
    with pytest.raises(ModelError) as err:
        target_modules(tiny_model("llama"), ["qproj"])
    assert "qproj match no Linear layer" in str(err.value) and "q_proj" in str(err.value)
    with pytest.raises(ModelError, match="give it alone"):
        target_modules(tiny_model("llama"), ["all-linear", "q_proj"])


def test_missing_model_path_names_path_and_choices(tmp_path):
    with pytest.raises(ModelError) as err:
        load_model(ModelArgs(name_or_path=str(tmp_path / "nowhere")))
    assert str(tmp_path / "nowhere") in str(err.value) and "smollm2-135m-instruct" in str(err.value)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        load_model(ModelArgs(name_or_path=str(tmp_path)))


def test_hf_folder_loads(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded, tok = load_model(ModelArgs(name_or_path=str(tmp_path / "m"), dtype="bfloat16"))
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))
    assert tok("hi")["input_ids"] == tiny_tokenizer()("hi")["input_ids"]


def test_gguf_of_unsupported_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError) as err:
        load_model(ModelArgs(name_or_path=str(path), cache_dir=str(tmp_path / "cache")))
    message = str(err.value)
    assert str(path) in message and "'rwkv6'" in message and "llama" in message
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        load_model(ModelArgs(name_or_path=str(path), cache_dir=str(tmp_path / "cache")))


def test_half_written_cache_names_the_folder_and_the_fix(tmp_path):
    folder = tmp_path / "models" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelError) as err:
        load_model(ModelArgs(cache_dir=str(tmp_path)))
    assert f"model cache {folder} is incomplete" in str(err.value) and f"rm -r {folder}" in str(err.value)

    (folder / "model.safetensors").write_bytes(b"x" * 10)
    (folder / "raylora-cache.json").write_text(json.dumps({"files": {"config.json": 2, "model.safetensors": 1000}}))
    with pytest.raises(ModelError, match="model.safetensors missing or truncated"):
        load_model(ModelArgs(cache_dir=str(tmp_path)))


def test_saving_an_adapter_of_a_hub_named_base_asks_no_hub(tmp_path, monkeypatch):
    """An adapter records its base's Hub id; peft's embedding check then looked that id up on the Hub at every save
    (a download on a machine online, a warning per checkpoint offline)."""
    import peft.utils.save_and_load

    from raylora.train import checkpoint as ckpt
    from raylora.train.checkpoint import TrainState

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(
        peft.utils.save_and_load, "check_file_exists_on_hf_hub", lambda *a, **k: pytest.fail("the Hub was asked")
    )
    base = tiny_model("llama")
    base.name_or_path = base.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = attach_lora(base, LoraArgs())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    ckpt.save(tmp_path, model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), TrainState(),
              load_config(None, []))  # fmt: skip
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
