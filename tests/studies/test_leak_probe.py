"""The leak probe's command line on a tiny model (CPU): every stage back to the trained
trainer's level and nothing alive after the drop, with the memory flags off and on."""

import re

from studies.memory.leak_probe import main


def test_every_stage_returns_to_the_trained_trainer(capsys):
    main(["--hidden", "64", "--layers", "2", "--seq", "64", "--micro", "2", "--cpu"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("flags")]
    assert [x[:9] for x in lines] == ["flags off", "flags on "]
    for line in lines:
        stages = dict(re.findall(r"(steps|loss_check|dense step|oom forward|oom backward|"
                                 r"ell step|dropped) ([+-]\d+\.\d)", line))
        assert len(stages) == 7, line
        assert all(abs(float(v)) <= 0.1 for v in stages.values()), line
        assert line.endswith("a parameter alive: False"), line
