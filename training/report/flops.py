"""Model FLOPs per token, achieved TFLOP/s and MFU, and this process's peak memory (gathered over a group)."""

import resource
import sys
from pathlib import Path

import torch

from parallel.collectives import all_gather_cat

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets; the first matching
# substring of torch.cuda.get_device_name() wins, so the more specific names come first.
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0))


def flops_per_token(decoder, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6 N + 12 L H Q T. N counts the matmul weights a
    token meets (the family's `matmul_params_per_token`), L layers, H attention heads, Q head dim, T the sequence
    length; attention scores are counted over the whole sequence (no causal halving), as PaLM, Megatron-LM and
    torchtitan do, so MFU figures compare across those reports."""
    c = decoder.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 6.0 * decoder.adapter.matmul_params_per_token() + \
        12.0 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq_len


def device_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a known CUDA device, None elsewhere (CPU, unknown GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)


def throughput_record(tokens_per_s: float, flops_token: float, world_size: int,
                      peak_tflops: float | None) -> dict[str, float]:
    """Achieved TFLOP/s per device (`tflops`) and, when a per-device peak is known, `mfu` (a fraction)."""
    tflops = tokens_per_s * flops_token / world_size / 1e12
    record = {"tflops": tflops}
    if peak_tflops:
        record["mfu"] = tflops / peak_tflops
    return record


def process_peak_memory(device: torch.device) -> int:
    """Peak bytes of this process: CUDA max_memory_allocated on a GPU, else the peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    status = Path("/proc/self/status")
    if status.exists():  # VmHWM: ru_maxrss survives exec and would count the launcher's memory at fork
        return next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines() if line.startswith("VmHWM"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def peak_memory_record(group, device: torch.device) -> dict[str, int]:
    """Collective over group (None: this process alone): the largest peak and the group rank holding it."""
    mine = torch.tensor([process_peak_memory(device)], dtype=torch.int64, device=device)
    peaks = all_gather_cat(mine, group, dim=0)
    rank = int(torch.argmax(peaks).item())
    return {"peak_mem_bytes": int(peaks[rank].item()), "peak_mem_rank": rank}


def world_group(grid) -> "torch.distributed.ProcessGroup | None":
    """Every process of the run (None alone): the group peak memory is gathered over."""
    return torch.distributed.group.WORLD if grid.world_size > 1 else None
