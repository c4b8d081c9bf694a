"""studies.multi_gpu: the two-GPU acceptance report on hand-made metrics files with known answers
(loss and grad-norm differences over common steps, resumed-run steps, speed medians and ratios),
and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies.multi_gpu import main, max_diff, report_lines, speed, train_rows


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"kind": "val", "step": 0})] + [json.dumps({"kind": "train", **r})
                                                          for r in rows]
    path.write_text("\n".join(lines) + "\n\n")


def _curve(steps, loss, grad=1.0, **extra):
    return [{"step": s, "loss": loss(s), "grad_norm": grad, "l0_mean": 12.25,
             "ffn_paths": ["ell", "dense"], **extra} for s in steps]


def _fake_out(tmp_path: Path) -> Path:
    out = tmp_path / "mgc"
    base = lambda s: 4.0 - s / 64  # binary fractions: every difference below is exact
    _write(out / "one_torch" / "metrics.jsonl", _curve(range(1, 5), base))
    _write(out / "two_torch" / "metrics.jsonl",
           _curve(range(1, 5), lambda s: base(s) + (0.125 if s == 3 else 0.0), grad=1.5))
    _write(out / "one_auto" / "metrics.jsonl", _curve(range(1, 5), lambda s: base(s) + 0.25))
    _write(out / "two_auto" / "metrics.jsonl", _curve(range(1, 5), lambda s: base(s) + 0.5))
    _write(out / "resume_two_on_one" / "metrics.jsonl",
           _curve(range(3, 5), lambda s: base(s) + 0.5 + 2 ** -10))
    for name, rates in (("speed_one", [1.0, 100.0, 120.0, 110.0]),
                        ("speed_ddp", [5.0, 200.0, 190.0, 210.0]),
                        ("speed_fsdp", [5.0, 180.0])):
        _write(out / f"{name}.metrics.jsonl",
               [{"step": 2 * i, "loss": 1.0, "tokens_per_s": r, "peak_mem_gb": 10.0 + i}
                for i, r in enumerate(rates, 1)])
    return out


def test_helpers_hand_computed(tmp_path):
    a = {1: {"loss": 1.0}, 2: {"loss": 2.0}, 3: {"loss": 3.0}}
    b = {2: {"loss": 2.5}, 3: {"loss": 2.75}, 4: {"loss": 9.0}}
    assert max_diff(a, b) == (0.5, 2)  # steps 2 and 3 only
    with pytest.raises(ValueError, match="no logged step"):
        max_diff(a, {7: {"loss": 1.0}})
    assert speed({2: {"tokens_per_s": 1.0}, 4: {"tokens_per_s": 3.0},
                  6: {"tokens_per_s": 5.0}}) == (4.0, 2)  # the first log is left out
    _write(tmp_path / "m.jsonl", [{"step": 1, "loss": 2.0}])
    assert train_rows(tmp_path / "m.jsonl") == {1: {"kind": "train", "step": 1, "loss": 2.0}}


def test_report_lines(tmp_path):
    lines = report_lines(_fake_out(tmp_path))
    assert lines[0] == ("ffn_impl=torch: 2 GPUs vs 1 GPU over 4 steps: max |loss diff| 0.125, "
                        "max |grad norm diff| 0.5")
    assert lines[1].startswith("ffn_impl=auto: 2 GPUs vs 1 GPU over 4 steps: max |loss diff| 0.25,")
    assert lines[2] == "bf16 noise scale: 1 GPU torch vs auto over 4 steps: max |loss diff| 0.25"
    assert lines[3] == ("sparsity at step 4 (1 GPU, auto): L0 12.2 of the FFN width, paths "
                        "['ell', 'dense']")
    assert lines[4] == ("2-GPU checkpoint resumed on 1 GPU: 2 steps, max |loss diff| vs the 2-GPU "
                        f"run {2 ** -10:.4g} (vs 1 GPU straight: {0.25 + 2 ** -10:.4g})")
    assert lines[5] == "speed_one: 110 tokens/s (median of 3 logs), peak 14.0 GB"
    assert lines[6] == "speed_ddp: 200 tokens/s (median of 3 logs), peak 14.0 GB"
    assert lines[7] == "speed_fsdp: 180 tokens/s (median of 1 logs), peak 12.0 GB"
    assert lines[8] == "1.5B tokens/s ratio ddp 2 GPUs / 1 GPU: 1.82x (target >= 1.85x)"
    assert lines[9] == "1.5B tokens/s ratio fsdp 2 GPUs / 1 GPU: 1.64x (target >= 1.85x)"


def test_main_prints_the_report_and_names_a_missing_run(tmp_path, capsys):
    out = _fake_out(tmp_path)
    assert main([str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == report_lines(out)
    (out / "two_auto" / "metrics.jsonl").unlink()
    assert main([str(out)]) == 1
    assert "two_auto" in capsys.readouterr().err
    assert main([]) == 2
