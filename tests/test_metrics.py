"""Model FLOPs per token, TFLOP/s and MFU, peak memory per rank, and the records that carry them."""

import json

import pytest
import torch

from minimind import MiniMindConfig, MiniMindForCausalLM
from models import build_model, decoder_of
from parallel.decoder import Decoder
from tests.equivalence import compose_run_config
from tests.spawn import run_workers
from training.report.flops import (device_peak_tflops, flops_per_token, peak_memory_record, process_peak_memory,
                            throughput_record)
from training.report.metrics import MetricsLogger


def meta_decoder(config: MiniMindConfig) -> Decoder:
    """The model of `config` on the meta device, as the parallel layer sees it."""
    return decoder_of(build_model(config, device="meta"))


def matmul_params_per_token(config: MiniMindConfig) -> int:
    """The family adapter's count of the weights one token multiplies with."""
    return meta_decoder(config).adapter.matmul_params_per_token()


def linear_weights(config: MiniMindConfig) -> int:
    """Every nn.Linear weight of the built model (meta device: no memory)."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(config)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_dense_matmul_weights_are_the_models_linear_layers():
    config = MiniMindConfig(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                            vocab_size=500)
    assert matmul_params_per_token(config) == linear_weights(config)


def test_moe_counts_only_the_experts_a_token_runs_through():
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=300, use_moe=True, num_experts=4, num_experts_per_tok=1)
    expert = 3 * 64 * config.moe_intermediate_size
    assert matmul_params_per_token(config) == linear_weights(config) - 2 * 3 * expert  # 3 idle experts per layer


def test_flops_per_token_adds_the_attention_term():
    config = MiniMindConfig(hidden_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
    n, decoder = matmul_params_per_token(config), meta_decoder(config)
    assert flops_per_token(decoder, 256) == 6 * n + 12 * 8 * 8 * 96 * 256
    assert flops_per_token(decoder, 512) - flops_per_token(decoder, 256) == 12 * 8 * 768 * 256


def test_tflops_per_device_and_mfu():
    record = throughput_record(tokens_per_s=1e6, flops_token=6e8, world_size=4, peak_tflops=300.0)
    assert record == pytest.approx({"tflops": 150.0, "mfu": 0.5})
    assert "mfu" not in throughput_record(1e6, 6e8, 4, None)


def test_no_peak_on_cpu():
    assert device_peak_tflops(torch.device("cpu")) is None


def test_peak_memory_of_this_process_sees_a_large_allocation():
    block = torch.ones(64 * 2**20 // 4 * 4)  # 256 MiB, touched
    assert process_peak_memory(torch.device("cpu")) >= block.numel() * 4


def _peaks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        torch.ones(96 * 2**20)  # 384 MiB more than the other rank holds, freed at once: the peak keeps it
    return peak_memory_record(dist.group.WORLD, torch.device("cpu"))


def test_peak_memory_is_gathered_with_the_rank_that_holds_it():
    records = run_workers(_peaks, 2, timeout=120, fresh=True)  # its own process group and peak memory
    assert records[0] == records[1]  # every rank gets the same answer
    assert records[0]["peak_mem_rank"] == 1 and records[0]["peak_mem_bytes"] >= 384 * 2**20


def test_alone_the_record_is_this_process():
    record = peak_memory_record(None, torch.device("cpu"))
    assert record["peak_mem_rank"] == 0 and record["peak_mem_bytes"] == process_peak_memory(torch.device("cpu"))


def test_mfu_appears_when_a_peak_is_set(tmp_path):
    cfg = compose_run_config(["model=tiny", "train.steps=1", "logger=none", "train.peak_tflops=0.5"],
                             tmp_path / "cache")
    metrics = MetricsLogger(tmp_path / "run", cfg, enabled=True, device=torch.device("cpu"))
    metrics.log(1, {"loss": 1.0, "tokens_per_s": 1000.0})
    metrics.close()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    given = {k: v for k, v in cfg.model.items() if k not in ("name", "hf_config") and v is not None}
    flops = flops_per_token(meta_decoder(MiniMindConfig(**given)), cfg.train.seq_len)
    assert record["tflops"] == pytest.approx(1000.0 * flops / 1e12)
    assert record["mfu"] == pytest.approx(record["tflops"] / 0.5)


def test_a_pp2_run_logs_tflops_and_peak_memory_to_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.equivalence import layout_worker

    run_dir = tmp_path / "run"
    overrides = ["model=tiny", "schedule.n_microbatches=2", "train.steps=2", "parallel.pp=2", "logger=tensorboard"]
    run_workers(layout_worker, 2, overrides, str(tmp_path / "cache"), str(run_dir), timeout=300)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["tflops"] > 0 and "mfu" not in record  # CPU: no known peak, none set
        assert record["peak_mem_rank"] in (0, 1) and record["peak_mem_bytes"] > 50 * 2**20
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert {"train/tflops", "train/peak_mem_bytes", "train/peak_mem_rank"} <= set(events.Tags()["scalars"])
