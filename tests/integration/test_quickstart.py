import json
import subprocess
import sys

import torch
from peft import PeftModel

from raylora.models import tiny_model


def test_quickstart_job_trains_saves_a_peft_adapter_and_answers(tmp_path, root):
    data = tmp_path / "rows.jsonl"
    good = [
        {"instruction": f"Say {w}.", "input": "", "output": f"{w} from {{{{name}}}}"} for w in ("one", "two", "three")
    ]
    bad = [{"instruction": "no answer"}, {"instruction": "hi", "output": ""}]
    data.write_text("\n".join(json.dumps(r) for r in good + bad) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "jobs/quickstart.py", "configs/tiny_lora_cpu.yaml", f"data.sources=[{{path: {data}}}]",
         f"train.output_dir={out}", "train.max_steps=30", "train.lr=3e-2"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 30/30" in proc.stdout and "with adapter:" in proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rows_read"], summary["rows_kept"], summary["rows_rejected"]) == (5, 3, 2)
    assert sum(summary["losses"][-5:]) / 5 < 0.8 * sum(summary["losses"][:5]) / 5
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [
        (4, "field 'output' is missing, expected a string"),
        (5, "empty response"),
    ]
    assert json.loads((out / "config.json").read_text())["train"]["max_steps"] == 30

    adapter = PeftModel.from_pretrained(tiny_model("llama"), out / "adapter")
    lora_b = [p for n, p in adapter.named_parameters() if "lora_B" in n]
    assert lora_b and all(torch.isfinite(p).all() for p in lora_b) and any(p.abs().sum() > 0 for p in lora_b)


def test_quickstart_with_no_usable_row_fails_clearly(tmp_path, root):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"instruction": "x"}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "raylora.cli", "quickstart", "configs/tiny_lora_cpu.yaml",
         f"data.sources=[{{path: {data}}}]", f"train.output_dir={tmp_path}/out"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2  # bad data: bad input
    assert "no usable training row" in proc.stderr and "Traceback" not in proc.stderr
