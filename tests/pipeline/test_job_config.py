import dataclasses
import json

import pytest

from adt_core.config import AdaptiveConfig, DecodeConfig, LanternConfig, TreeConfig
from jobs.generate import main as cli_main
from pipeline.config import ConfigError, JobConfig, build_config, leaf_fields, load_config, parse_cli_value
from pipeline.decode_config import FIELD_DOCS
from pipeline.exit_codes import EXIT_BAD_INPUT


def test_defaults_fill_job_id_and_output():
    cfg = build_config({})
    assert cfg.job_id and cfg.output == f"outputs/{cfg.job_id}"
    assert cfg.input == "examples/prompts.parquet" and cfg.bundle == "emoji16"
    assert cfg.decode.method == "adt" and cfg.decode.adaptive.budget == "cost" and cfg.decode.tree.depth is None  # eagle2: sized for the device


def test_decode_defaults_are_the_engines():
    # one config tree: the job's decode section builds exactly the engine's default DecodeConfig
    assert build_config({}).decode.engine_config("cpu") == DecodeConfig(device="cpu")
    assert build_config({}).rows_per_call() == 4 * DecodeConfig().batch_size
    engine = {"decode." + f.name for f in dataclasses.fields(DecodeConfig) if f.name != "device"}
    for name, cls in (("tree", TreeConfig), ("adaptive", AdaptiveConfig), ("lantern", LanternConfig)):
        engine |= {f"decode.{name}.{f.name}" for f in dataclasses.fields(cls)}
    specs = {s.dotted for s in leaf_fields()}
    assert engine <= specs  # every engine field is an option (device is set per actor)
    assert "decode.device" not in specs


def test_job_yaml_reaches_the_engine(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("decode:\n  method: static\n  adaptive: {d_max: 6}\n  lantern: {delta: 0.25}\n"
                 "  tree:\n    depth: 3\n    static_paths: [[0], [1], [0, 0], [0, 0, 0]]\n")
    cfg = load_config(f, {"decode.adaptive.beta": "0.7", "decode.lantern.k": "20"})
    dc = cfg.decode.engine_config("cuda:0")
    assert isinstance(dc, DecodeConfig) and dc.device == "cuda:0" and dc.method == "static"
    assert dc.adaptive == AdaptiveConfig(d_max=6, beta=0.7)  # other fields: the engine's defaults
    assert dc.lantern == LanternConfig(k=20, delta=0.25)
    assert dc.tree == TreeConfig(depth=3, static_paths=((0,), (1,), (0, 0), (0, 0, 0)))
    assert cfg.decode.engine_config("cpu", method="ar").method == "ar"  # the baseline's config
    saved = json.loads(cfg.to_json())["decode"]  # job.json holds every engine field
    assert saved["tree"]["static_paths"] == [[0], [1], [0, 0], [0, 0, 0]] and saved["lantern"]["lam"] is None
    again = build_config({"decode": saved})
    assert again.decode.engine_config("cuda:0") == dc


def test_lantern_set_whole_or_off_from_the_command_line():
    specs = {s.dotted: s for s in leaf_fields()}
    on = build_config(overrides={"decode.lantern": parse_cli_value(specs["decode.lantern"], '{"delta": 0.3}')})
    assert on.decode.engine_config("cpu").lantern == LanternConfig(delta=0.3)
    off = build_config({"decode": {"lantern": {"k": 5}}}, {"decode.lantern": parse_cli_value(specs["decode.lantern"], "none")})
    assert off.decode.lantern is None
    tree = parse_cli_value(specs["decode.tree.static_paths"], "[[0], [1]]")
    assert build_config(overrides={"decode.tree.static_paths": tree}).decode.tree.static_paths == ((0,), (1,))


@pytest.mark.parametrize(
    "data, where",
    [
        ({"decode": {"adaptive": {"d_max": 0}}}, "decode.adaptive.d_max: must be an integer >= 1 (got 0)"),
        ({"decode": {"adaptive": {"d_min": 9, "d_max": 3}}}, "decode.adaptive.d_min: must be <= adaptive.d_max (3)"),
        ({"decode": {"adaptive": {"budget": "costly"}}}, "decode.adaptive.budget: must be shape or cost"),
        ({"decode": {"lantern": {"delta": 1.5}}}, "decode.lantern.delta: must be in [0, 1] (got 1.5)"),
        ({"decode": {"lantern": {"lam": 0.5}}}, "decode.lantern.lam: must be none or a number >= 1"),
        ({"decode": {"tree": {"static_paths": [[0], [1, 0]]}}}, "decode.tree.static_paths: static path (1, 0) lacks"),
        ({"decode": {"temperature": float("inf")}}, "decode.temperature: must be a finite number >= 0"),
        ({"decode": {"adaptive": {"dmax": 4}}}, "decode.adaptive.dmax: unknown field"),
        ({"decode": {"device": "cuda"}}, "decode.device: unknown field"),  # set per actor (JobConfig.device)
    ],
)
def test_engine_rules_name_the_field(data, where):
    with pytest.raises(ConfigError) as e:
        build_config(data)
    assert where in str(e.value)


def test_bad_decode_file_exits_2_with_one_clear_line(tmp_path, capsys):
    f = tmp_path / "job.yaml"
    f.write_text("decode:\n  adaptive: {d_max: 1}\n")  # below d_min
    assert cli_main(["--config", str(f), "--print-config"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: invalid job config:", "  decode.adaptive.d_min: must be <= adaptive.d_max (1) (got 2)"]


def test_file_then_overrides(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("job_id: nightly\nnum_actors: 3\ndecode:\n  method: ar\n  tree: {depth: 7}\n")
    cfg = load_config(f, {"num_actors": "2", "decode.tree.top_k": "4", "decode.temperature": "0"})
    assert cfg.num_actors == 2  # CLI beats file
    assert cfg.decode.method == "ar" and cfg.decode.tree.depth == 7 and cfg.decode.tree.top_k == 4
    assert cfg.decode.temperature == 0.0
    assert cfg.output == "outputs/nightly"


def test_json_file_accepted(tmp_path):
    f = tmp_path / "job.json"
    f.write_text(json.dumps({"batch_size": 8, "resume": True}))
    cfg = load_config(f)
    assert cfg.batch_size == 8 and cfg.resume is True


@pytest.mark.parametrize(
    "data, field",
    [
        ({"decode": {"tree": {"depth": 0}}}, "decode.tree.depth"),
        ({"decode": {"method": "medusa"}}, "decode.method"),
        ({"num_actors": "many"}, "num_actors"),
        ({"baseline_fraction": 1.5}, "baseline_fraction"),
        ({"storage": {"endpoint_url": "localhost:9000"}}, "storage.endpoint_url"),
        ({"job_id": "../escape"}, "job_id"),
        ({"decode": {"temprature": 1.0}}, "decode.temprature"),  # typo -> unknown field
        ({"input": "  "}, "input"),
    ],
)
def test_invalid_values_name_the_field(data, field):
    with pytest.raises(ConfigError) as e:
        build_config(data)
    assert field + ":" in str(e.value)


def test_bad_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_hash_ignores_scale_out_and_tracks_decoding():
    a = build_config({"job_id": "a", "num_actors": 1, "batch_size": 2})
    b = build_config({"job_id": "b", "num_actors": 8, "batch_size": 16, "resume": True, "output": "s3://x/y"})
    c = build_config({"job_id": "a", "decode": {"tree": {"depth": 6}}})
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_job_json_round_trip(tmp_path):
    cfg = build_config({"job_id": "rt", "decode": {"lantern": {"k": 50, "delta": 0.3}}})
    text = cfg.to_json()
    assert json.loads(text)["config_hash"] == cfg.config_hash()
    (tmp_path / "job.json").write_text(text)
    again = load_config(tmp_path / "job.json")  # a saved job.json feeds back in
    assert again == cfg and again.config_hash() == cfg.config_hash()


def test_every_leaf_is_documented_and_parses():
    specs = {s.dotted: s for s in leaf_fields(JobConfig)}
    assert {"input", "output", "bundle", "decode.tree.budget", "storage.endpoint_url", "num_actors"} <= specs.keys()
    assert all(s.description for s in specs.values())
    assert parse_cli_value(specs["limit"], "none") is None
    assert parse_cli_value(specs["decode.adaptive"], '{"d0": 4}') == {"d0": 4}
    assert parse_cli_value(specs["decode.adaptive.d0"], "4") == "4"  # pydantic coerces, naming the field
    assert set(FIELD_DOCS) >= {s.dotted.removeprefix("decode.") for s in specs.values() if s.dotted.startswith("decode.")}
    assert parse_cli_value(specs["job_id"], "0123") == "0123"  # stays a string


def test_unset_sampling_fields_take_the_bundles_defaults():
    dc = build_config({"decode": {"temperature": 0.0}}).decode.engine_config("cpu")
    assert dc.temperature == 0.0 and dc.top_p is None and dc.tree == TreeConfig()


def test_docs_decode_section_matches_the_cli(capsys):
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).resolve().parents[2] / "docs" / "pipeline.md").read_text()
    section = doc[doc.index("### The decode section"):]
    example, error = re.findall(r"```(?:yaml)?\n(.*?)```", section, re.S)[:2]
    dc = build_config(yaml.safe_load(example)).decode.engine_config("cpu")  # the documented file is valid
    assert dc.method == "static" and dc.adaptive.d_max == 6 and dc.lantern == LanternConfig(delta=0.25)
    assert cli_main(["--decode.adaptive.d-max", "1", "--print-config"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == error  # what the docs show is what the command prints
