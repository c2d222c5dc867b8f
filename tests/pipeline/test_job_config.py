import json

import pytest

from pipeline.config import ConfigError, JobConfig, build_config, leaf_fields, load_config, parse_cli_value


def test_defaults_fill_job_id_and_output():
    cfg = build_config({})
    assert cfg.job_id and cfg.output == f"outputs/{cfg.job_id}"
    assert cfg.input == "examples/prompts.parquet" and cfg.bundle == "emoji16"
    assert cfg.decode.method == "adt" and cfg.decode.adaptive == {"budget": "cost"} and cfg.decode.tree.depth == 5


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
    assert parse_cli_value(specs["job_id"], "0123") == "0123"  # stays a string


def test_engine_dict_drops_unset_fields():
    cfg = build_config({"decode": {"temperature": 0.0}})
    d = cfg.decode.engine_dict("cpu")
    assert d["temperature"] == 0.0 and d["device"] == "cpu" and "top_p" not in d
    assert d["tree"] == {"depth": 5, "top_k": 10, "budget": 58}
