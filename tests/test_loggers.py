"""Metric sinks: several at once with the config recorded in each, strict JSON, checks, no leak on failure."""

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.equivalence import compose_run_config
from training.report.loggers import logger_problem, logger_backends
from training.report.metrics import MetricsLogger

RECORD = {"loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0, "step_time_s": 0.1,
          "expert_imbalance": 1.25, "expert_imbalance_by_layer": {"layer0": 1.0, "layer1": 1.5}}


def run_config(tmp_path, backends: list[str], *overrides: str):
    """The composed run config with these logger.backends."""
    return compose_run_config(["model=tiny", "train.steps=2", *overrides, f"logger.backends=[{','.join(backends)}]"],
                              tmp_path / "cache")


def wandb_records(run_file: Path) -> list:
    """Records of an offline wandb run file: a 7-byte header, then LevelDB log blocks of 32 KiB."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, records = run_file.read_bytes(), 7, b"", []
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_tensorboard_and_wandb_at_once_each_record_the_config(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = run_config(tmp_path, ["tensorboard", "wandb"], "logger=wandb")
    metrics = MetricsLogger(tmp_path / "run", cfg, enabled=True)
    metrics.log(1, RECORD)
    metrics.close()

    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert len(list((tmp_path / "run" / "tb").iterdir())) == 1  # hparams share the one event file
    assert "train/loss" in events.Tags()["scalars"]
    # A per-layer dict (the MoE load) is one chart per layer.
    assert {"train/expert_imbalance_by_layer/layer0", "train/expert_imbalance_by_layer/layer1"} <= set(
        events.Tags()["scalars"])
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "hidden_size: 64" in text
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["model.hidden_size"].number_value == 64
    assert hparams["schedule.name"].string_value == "1f1b"

    run_file = next((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    records = wandb_records(run_file)
    configs = [r.run.config for r in records if r.WhichOneof("record_type") == "run"]
    recorded = {item.key: json.loads(item.value_json) for item in configs[0].update}
    assert recorded["model"]["hidden_size"] == 64 and recorded["train"]["steps"] == 2


def test_metrics_jsonl_is_strict_json(tmp_path):
    cfg = run_config(tmp_path, ["none"])
    metrics = MetricsLogger(tmp_path / "run", cfg, enabled=True)
    metrics.log(1, {**RECORD, "loss": float("nan"), "grad_norm": float("inf")})
    metrics.close()

    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    line = (tmp_path / "run" / "metrics.jsonl").read_text().strip()
    record = json.loads(line, parse_constant=refuse)
    assert record["loss"] is None and record["grad_norm"] is None and record["lr"] == 1e-3


def open_paths() -> set[str]:
    """Files this process holds open (Linux /proc)."""
    fd_dir = Path("/proc/self/fd")
    paths = set()
    for fd in fd_dir.iterdir():
        try:
            paths.add(os.readlink(fd))
        except OSError:
            pass
    return paths


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")
def test_a_logger_that_fails_to_start_leaves_no_file_open(tmp_path, monkeypatch):
    import torch.utils.tensorboard

    def broken_writer(*args, **kwargs):
        raise RuntimeError("tensorboard cannot start")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", broken_writer)
    cfg = run_config(tmp_path, ["tensorboard"], "logger=tensorboard")
    with pytest.raises(RuntimeError, match="tensorboard cannot start") as failure:
        MetricsLogger(tmp_path / "run", cfg, enabled=True)
    # The traceback keeps the half-built logger alive: only an explicit close frees the file.
    assert failure.value is not None
    assert str((tmp_path / "run" / "metrics.jsonl").resolve()) not in open_paths()


def test_backends_drop_none_and_repeats():
    assert logger_backends(OmegaConf.create({"logger": {"backends": ["none"]}})) == []
    both = OmegaConf.create({"logger": {"backends": ["tensorboard", "wandb", "tensorboard"]}})
    assert logger_backends(both) == ["tensorboard", "wandb"]


@pytest.mark.parametrize("logger, env, expected", [
    ({"backends": ["tensorboard", "wandb"], "mode": "offline", "project": "p"}, {}, None),
    ({"backends": ["tensorbord"], "mode": "offline", "project": "p"}, {}, "unknown logger 'tensorbord'"),
    ({"backends": ["none", "wandb"], "mode": "offline", "project": "p"}, {}, "mixes none"),
    ({"backends": ["wandb"], "mode": "bogus", "project": "p"}, {}, "logger.mode=bogus is not a wandb mode"),
    ({"backends": ["tensorboard"], "mode": "bogus", "project": "p"}, {}, None),  # mode is wandb's only
    ({"backends": ["wandb"], "mode": "offline", "project": ""}, {}, "logger.project is empty"),
    ({"backends": ["wandb"], "mode": "online", "project": "p"}, {}, "needs wandb credentials"),
    ({"backends": ["wandb"], "mode": "online", "project": "p"}, {"WANDB_API_KEY": "x" * 40}, None),
])
def test_logger_problem(tmp_path, monkeypatch, logger, env, expected):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    problem = logger_problem(OmegaConf.create({"logger": logger}))
    if expected is None:
        assert problem is None
    else:
        assert expected in problem and "\n" not in problem


def test_wandb_credentials_from_netrc(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    os.chmod(tmp_path / "netrc", 0o600)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = OmegaConf.create({"logger": {"backends": ["wandb"], "mode": "online", "project": "p"}})
    assert logger_problem(cfg) is None
