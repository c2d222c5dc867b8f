"""One command-line convention for every job (pipeline/cli.py): `_` and `-` spell the same
flag, abbreviations are refused, and a bad flag prints a usage line and one error line, exit 2."""

from __future__ import annotations

import pytest

from jobs import bench, chaos, generate, report, samples, scale, study, train_drafter
from pipeline import bench as pipeline_bench
from pipeline.cli import EXIT_BAD_FLAG

# job -> (its parser, the same flags in both spellings, an abbreviation of one of its flags)
JOBS = {
    "generate": (generate.build_parser, ["--decode.batch_size", "3", "--decode.tree.top_k=4", "--num_actors", "2",
                                         "--no_resume", "--storage.endpoint_url", "http://127.0.0.1:9"], "--num-act"),
    "bench": (bench.build_parser, ["--lantern_k", "5", "--min_images", "3", "--no_baseline", "--caption_len", "8",
                                   "--grid", "4", "4"], "--min-im"),
    "study": (study.build_parser, ["--local_cpus", "2", "--ray_address=auto", "--images", "4"], "--local"),
    "train_drafter": (train_drafter.build_parser, ["--train.batch_size", "4", "--eval.max_tokens", "2", "--num_workers",
                                                   "2", "--eval_prompts", "p.parquet", "--no_export_bundle"], "--num-work"),
}
MAINS = {"generate": generate.main, "bench": bench.main, "study": study.main, "train_drafter": train_drafter.main,
         "report": lambda argv: report.main(["outputs/x", *argv]), "pipeline.bench": pipeline_bench.main,
         "samples": samples.main, "scale": scale.main, "chaos": chaos.main}


def _dashed(argv: list[str]) -> list[str]:
    return [a.partition("=")[0].replace("_", "-") + a.partition("=")[1] + a.partition("=")[2] if a.startswith("--") else a
            for a in argv]


@pytest.mark.parametrize("job", sorted(JOBS))
def test_underscore_and_dash_spell_the_same_flags(job):
    parser, argv, _ = JOBS[job]
    underscored, dashed = vars(parser().parse_args(argv)), vars(parser().parse_args(_dashed(argv)))
    assert underscored == dashed
    given = {k for k, v in underscored.items() if v not in (None, False, [])}
    assert len(given) >= sum(a.startswith("--") for a in argv) - 1  # each flag reached its field (one --no-x each)


def test_generate_flags_reach_the_config(capsys):
    assert generate.main(["--decode.batch_size", "3", "--decode.tree.top-k", "4", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert '"batch_size": 3' in out and '"top_k": 4' in out


@pytest.mark.parametrize("job", sorted(JOBS))
def test_abbreviations_are_refused(job, capsys):
    main = MAINS[job]
    with pytest.raises(SystemExit) as e:
        main([JOBS[job][2], "2"])
    assert e.value.code == EXIT_BAD_FLAG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and "unrecognized" in err[-1]


@pytest.mark.parametrize("job", sorted(MAINS))
def test_a_bad_flag_is_a_usage_line_and_one_error_line(job, capsys):
    with pytest.raises(SystemExit) as e:
        MAINS[job](["--decode.batchsize", "0"])
    assert e.value.code == EXIT_BAD_FLAG == 2  # the "bad config" code every job documents
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3, err
    assert err[0].startswith("usage: python -m ") and "error: unrecognized arguments: --decode.batchsize 0" in err[-1]


def test_the_closest_flag_is_named(capsys):
    with pytest.raises(SystemExit):
        generate.main(["--decode.batchsize", "0"])
    assert "(did you mean --decode.batch-size?)" in capsys.readouterr().err


@pytest.mark.parametrize("job, argv, field", [("bench", ["--limit", "x"], "limit"),
                                              ("study", ["--images", "0"], "images")])
def test_a_bad_value_names_its_field_on_one_line(job, argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        MAINS[job](argv)
    assert e.value.code == EXIT_BAD_FLAG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and f"{field}: " in err[1]


def test_help_groups_flags_by_section():
    text = generate.build_parser().format_help()
    for title in ("decode:", "decode.tree:", "decode.adaptive:", "storage:", "scale:"):
        assert f"\n{title}\n" in text, title
    assert "--decode.batch-size" in text
    assert "\ntrain:\n" in train_drafter.build_parser().format_help()
    assert "\n--throughput:\n" in bench.build_parser().format_help()


def test_train_drafter_set_stays_an_alias(capsys):
    argv = ["--bundle", "random", "--prompts", "p.parquet", "--out", "o", "--steps", "5", "--set", "train.lr=1e-3",
            "--print-config"]
    assert train_drafter.main(argv) == 0
    out = capsys.readouterr().out
    assert '"steps": 5' in out and '"lr": 0.001' in out
