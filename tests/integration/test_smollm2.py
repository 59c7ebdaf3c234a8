import pytest
import torch

from raylora import model_files
from raylora.config import ModelArgs
from raylora.model_files import SMOLLM2, cache_root, check_cache
from raylora.models import load_model
from raylora.train.quickstart import generate

pytestmark = pytest.mark.slow


def test_smollm2_is_converted_once_then_loaded_from_the_cache(monkeypatch):
    args = ModelArgs()
    model, tokenizer = load_model(args)
    folder = cache_root(args) / "models" / SMOLLM2
    check_cache(folder)
    assert {"config.json", "model.safetensors", "tokenizer.json", "raylora-cache.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert (model.config.model_type, model.config.num_hidden_layers, model.config.hidden_size) == ("llama", 30, 576)

    def no_conversion(path):
        raise AssertionError(f"the cache was not used: {path} was read again")

    monkeypatch.setattr(model_files, "gguf_architecture", no_conversion)
    cached, cached_tokenizer = load_model(args)
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(cached(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
    assert cached_tokenizer.chat_template == tokenizer.chat_template

    answer = generate(
        cached,
        cached_tokenizer,
        [{"role": "user", "content": "What is the capital of France?"}],
        torch.device("cpu"),
        24,
    )
    assert "Paris" in answer
