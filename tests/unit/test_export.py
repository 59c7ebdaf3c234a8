import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from raylora.config import ConfigError, ModelArgs, from_dict, to_dict
from raylora.export import export, quantize
from raylora.model_files import ModelError
from raylora.models import load_model, model_skeleton, tiny_model

IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 250, 11]])


@pytest.fixture
def adapter(tmp_path):
    model = get_peft_model(
        tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def _cfg(tmp_path, adapter, quantization):
    return from_dict({
        "model": {"name_or_path": "tiny-llama"},
        "data": {"sources": [{"path": "data/raylora_identity.jsonl"}], "cutoff_len": 128},
        "serve": {"calibration_rows": 8},
        "export": {"adapter": str(adapter), "quantization": quantization, "output_dir": str(tmp_path / quantization)},
    })  # fmt: skip


def test_merged_export_is_a_plain_hugging_face_folder_with_the_adapters_logits(tmp_path, adapter):
    out = export(_cfg(tmp_path, adapter, "none"), log=lambda _: None)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = PeftModel.from_pretrained(tiny_model("llama"), str(adapter)).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=1e-5)
    assert (out / "raylora_export.json").is_file() and (out / "tokenizer.json").is_file()


def test_int8_export_reloads_to_the_same_int8_model(tmp_path, adapter, root, monkeypatch):
    monkeypatch.chdir(root)
    cfg = _cfg(tmp_path, adapter, "w8a8-smoothquant")
    out = export(cfg, log=lambda _: None)
    reloaded, _ = load_model(ModelArgs(name_or_path=str(out)))
    expected = PeftModel.from_pretrained(tiny_model("llama"), str(adapter)).merge_and_unload().eval()
    tokenizer = load_model(ModelArgs(name_or_path="tiny-llama"))[1]
    summary = quantize(expected, tokenizer, cfg, "w8a8-smoothquant")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, expected(IDS).logits, atol=1e-6, rtol=1e-6)
    assert summary["alpha"] == 0.5 and (out / "raylora_int8.safetensors").stat().st_size < 0.4 * summary["bytes_before"]
    assert any(n.endswith(".smooth") for n, _ in reloaded.named_buffers())
    with pytest.raises(ConfigError, match="exists"):
        export(cfg, log=lambda _: None)


def test_int8_export_is_refused_by_plain_transformers_not_misread(tmp_path, adapter, root, monkeypatch):
    monkeypatch.chdir(root)
    out = export(_cfg(tmp_path, adapter, "w8a8"), log=lambda _: None)
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(out)
    assert "Only raylora reads this folder" in (out / "README.md").read_text()
    reloaded, _ = load_model(ModelArgs(name_or_path=str(out)))
    assert not hasattr(reloaded.config, "quantization_config")
    assert model_skeleton(ModelArgs(name_or_path=str(out))).config.num_hidden_layers == 2
    with pytest.raises(ModelError, match="already an int8 export"):  # its codes would be written as floats
        export(from_dict(to_dict(_cfg(tmp_path, adapter, "none")) | {"model": {"name_or_path": str(out)}}))
    (out / "raylora_int8.safetensors").rename(out / "model.safetensors")  # exported by an earlier raylora
    with torch.no_grad():
        torch.testing.assert_close(load_model(ModelArgs(name_or_path=str(out)))[0](IDS).logits, reloaded(IDS).logits)


def test_an_existing_output_folder_is_bad_input_exit_2(tmp_path, capsys):
    """Found by use: it exited 1, as a failed run, though nothing ran; the folder is the config's to change."""
    from raylora.cli import main

    assert main(["export", "configs/tiny_lora_cpu.yaml", f"export.output_dir={tmp_path}"]) == 2
    assert f"export.output_dir: {tmp_path} exists; remove it or choose another folder" in capsys.readouterr().err


def test_an_adapter_is_merged_only_into_the_base_it_was_trained_on(tmp_path, adapter):
    """Found by use: a tiny-llama adapter merged silently into tiny-qwen2 (same shapes, another model)."""
    cfg = _cfg(tmp_path, adapter, "none")
    cfg.model.name_or_path = "tiny-qwen2"
    with pytest.raises(ModelError, match="was trained on tiny-llama, and model.name_or_path=tiny-qwen2"):
        export(cfg, log=lambda _: None)
    assert not (tmp_path / "none").exists()
    # a folder counts by its name: the same model in another machine's cache still matches
    config = adapter / "adapter_config.json"
    config.write_text(config.read_text().replace('"tiny-llama"', '"/elsewhere/.cache/Tiny-Llama"'))
    cfg.model.name_or_path = "tiny-llama"
    assert export(cfg, log=lambda _: None).is_dir()
