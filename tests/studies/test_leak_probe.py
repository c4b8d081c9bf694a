"""The leak probe's command line on a tiny model (CPU): every stage back to the trained
trainer's level and nothing alive after the drop, with the memory flags off and on, the
selective-recompute stages running train.recompute's attention-only path; bad arguments refused
with one line naming the flag and the fix."""

import re

import pytest

from studies.memory.leak_probe import main
from train import recompute

STAGES = ("steps", "loss_check", "dense step", "oom forward", "oom backward", "ell step",
          "attention step", "attention oom forward", "attention oom ffn",
          "attention oom backward", "dropped")


def test_every_stage_returns_to_the_trained_trainer(capsys, monkeypatch):
    blocks = []  # the checkpointed attention halves the selective path ran (no reference
    block = recompute._attention_block  # to a layer kept: the drop must free them)
    monkeypatch.setattr(recompute, "_attention_block",
                        lambda layer, *a: blocks.append(1) or block(layer, *a))
    main(["--hidden", "64", "--layers", "2", "--seq", "64", "--micro", "2", "--cpu"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("flags")]
    assert [x[:9] for x in lines] == ["flags off", "flags on "]
    names = "|".join(sorted(STAGES, key=len, reverse=True))  # the longest name first
    for line in lines:
        stages = dict(re.findall(rf"(?:^|; )({names}) ([+-]\d+\.\d)", line))
        assert sorted(stages) == sorted(STAGES), line
        assert all(abs(float(v)) <= 0.1 for v in stages.values()), line
        assert line.endswith("a parameter alive: False"), line
    # per run: the step (forward and its backward's recomputation, 2 layers), the failed
    # attempts (forward in layer 1's attention: 2; in layer 1's FFN: 2; in backward: 2 + 1)
    assert len(blocks) == 2 * (4 + 2 + 2 + 3)


@pytest.mark.parametrize("argv, message", [
    (["--hidden", "100"], ("--hidden 100: the width must be a positive multiple of 64 "
                           "(attention heads of 64); pass e.g. --hidden 512")),
    (["--hidden", "0"], "--hidden 0: the width must be a positive multiple of 64"),
    (["--layers", "1"], ("--layers 1: the stages fail steps in layers 0 and 1; pass "
                         "--layers 2 or more")),
    (["--seq", "1"], ("--seq 1: a sequence needs 2 tokens or more (a next-token target); "
                      "pass e.g. --seq 256")),
    (["--micro", "0"], "--micro 0: the batch needs 1 sequence or more; pass e.g. --micro 4"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert f": error: {message}" in err[-1], err
    assert [x for x in err if "error" in x] == [err[-1]]  # the one line
