"""The Trainer: builds model, engine, optimizer and data for one rank of the grid, then runs the loop."""

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from checkpoint.distributed import TrainingState
from checkpoint.manager import CheckpointManager, find_checkpoint
from parallel.compile import CompileTrial, compile_mode
from parallel.decoder import Decoder
from parallel.engine import build_engine
from parallel.expert import expert_modules
from parallel.expert_load import ExpertLoad
from parallel.grid import ParallelGrid
from parallel.materialize import WeightSource, seeded_init
from parallel.recompute import unknown_roles
from training.config.schema import model_decoder
from training.config.run_length import resolve_epochs
from training.report.console import resume_command
from training.data import build_data, build_val_batches, run_data_spec
from training.methods.distill.teacher import with_inputs, with_teacher
from training.report.flops import peak_memory_record, world_group
from training.reliability.guard import StepGuard
from training.reliability.watchdog import Interrupted, exit_code
from training.report.metrics import MetricsLogger
from training.report.header import run_header
from training.specs import checkpoint_meta, checkpoint_spec, engine_spec, stage_weights
from training.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from checkpoint.dense_source import dense_source
from training.objectives.reference import compute_reference
from training.methods.grpo.step import GrpoStep
from parallel.pipeline.trace_files import write_trace
from training.layout_search.report import prediction_record

log = logging.getLogger("sluice")


def build_model(cfg: DictConfig) -> tuple[Decoder, WeightSource]:
    """The dense model on the meta device (as a Decoder: its plan and adapter) and where its weights come from:
    the dense checkpoint, or an initialisation seeded per parameter name by train.seed (the same weights in
    every layout)."""
    decoder = model_decoder(cfg)
    if not cfg.checkpoint.load_dense:
        return decoder, seeded_init(decoder, cfg.train.seed)

    expected = {name: tuple(t.shape) for name, t in decoder.module.state_dict().items()}
    return decoder, dense_source(cfg.checkpoint.load_dense, expected, decoder.plan.ties, decoder.config.model_type)


def seed_rng(seed: int, grid: ParallelGrid) -> None:
    """Seed this rank's RNG (dropout draws from it) from train.seed and its (pp, dp) coordinate. Every TP rank of a
    stage gets the same seed: they run the same ops on replicated activations (the embedding's dropout), whose masks
    must agree, or the replicated parameters drift apart. DP replicas and pipeline stages get their own streams, as a
    single process draws a fresh mask for every micro-batch and layer."""
    torch.manual_seed(seed * 1_000_003 + grid.pp_rank * 1_009 + grid.dp_rank)


def no_label_warning(steps: list[int], cfg: DictConfig, of: int | None = None) -> str:
    """A warning naming the steps that had no label token on any rank, with the likely cause."""
    cause = (f"every assistant token of their samples lies beyond train.seq_len={cfg.train.seq_len}; raise "
             "train.seq_len or use shorter conversations") if run_data_spec(cfg).chat \
        else "their samples hold no label token"
    which = f"step {steps[0]} has" if of is None else f"{len(steps)} of {of} steps ({', '.join(map(str, steps[:8]))}" \
        f"{', ...' if len(steps) > 8 else ''}) had"
    return f"{which} no label token on any rank: loss 0 and no gradient ({cause})"


class Trainer:
    """One rank's training loop; every layout differs only in the engine it builds."""

    def __init__(self, cfg: DictConfig, grid: ParallelGrid, run_dir: Path, guard: StepGuard | None = None):
        self.cfg, self.grid, self.run_dir = cfg, grid, Path(run_dir)
        self.guard = guard if guard is not None else StepGuard(cfg, grid)  # faults, hang watch, non-finite policy
        seed_rng(cfg.train.seed, grid)
        decoder, weights = build_model(cfg)
        for line in unknown_roles(decoder) if cfg.train.recompute == "selective" and grid.rank == 0 else ():
            log.warning(line)  # a part selective recompute leaves saved: said at start, not a silent change
        config, moe = decoder.config, bool(expert_modules(decoder))  # the whole model's, before any pass prunes it
        self.engine = build_engine(with_teacher(engine_spec(cfg, grid.device), cfg, grid), decoder, grid, weights)
        self.compile_mode = compile_mode(cfg.train.compile, grid.device)
        self.compile_trial = (CompileTrial(self.engine.chunks(), grid.device, world_group(grid))
                              if self.compile_mode == "auto" else None)  # times compiled and eager steps, keeps one
        self.expert_load = (ExpertLoad(self.engine.chunks(), config.num_hidden_layers, config.num_experts, grid.device)
                            if moe else None)
        self.optimizer = build_optimizer(self.engine.parameters(), cfg.optim, grid.dp_group, zero=cfg.parallel.zero,
                                         edp_group=grid.edp_group)
        self.data, self.tokenizer = build_data(cfg, grid.dp_rank, grid.dp, verbose=grid.rank == 0)
        resolve_epochs(cfg, self.data.num_samples, self.data.global_batch_size)  # train.epochs: steps from the data
        self.val_batches = (build_val_batches(cfg, grid.dp_rank, grid.dp, cfg.train.eval_batches)
                            if cfg.train.eval_every else None)
        self.dpo = OmegaConf.select(cfg, "train.task") == "dpo"
        self.distill = OmegaConf.select(cfg, "train.task") == "distill"  # the teacher reads each step's token ids
        if self.distill and self.val_batches:
            self.val_batches = [with_inputs(micro_batches) for micro_batches in self.val_batches]
        if self.dpo:  # before any step (or resume) moves the weights: they are the frozen reference now
            if grid.rank == 0:  # it reads every pair the run will train on before step 1: say so
                log.info("dpo: computing the reference log-probabilities (forward only, the starting weights) of the "
                         "pairs the %d steps read; step 1 follows", cfg.train.steps)
            compute_reference(self.engine, self.data, self.val_batches, cfg.train.steps, grid)
        self.grpo = (GrpoStep(cfg, self.engine, grid, self.tokenizer, self.run_dir)  # keeps the starting weights:
                     if OmegaConf.select(cfg, "train.task") == "grpo" else None)  # before any step or resume
        self.tokens_per_step = grid.dp * cfg.schedule.n_microbatches * cfg.train.micro_batch_size * cfg.train.seq_len
        state = TrainingState(self.engine, self.optimizer, grid, decoder.plan.ties)
        self.checkpoints = CheckpointManager(checkpoint_spec(cfg, self.run_dir), state, self.data,
                                             checkpoint_meta(cfg, grid), self.tokenizer,
                                             stage_weights(cfg, self.run_dir))

    def evaluate(self) -> dict[str, float]:
        """`val_loss` (token-weighted over the held-out batches, forward only) and `val_ppl`; under DPO the DPO loss
        and `val_reward_*` (means over the held-out pairs), under distillation the mixed loss, `val_ce_loss` and
        `val_distill_loss`, instead of a perplexity."""
        results = [self.engine.evaluate(micro_batches) for micro_batches in self.val_batches]
        tokens = sum(r.tokens for r in results)
        loss = sum(r.loss * r.tokens for r in results) / max(tokens, 1)
        if self.dpo or self.distill:
            means = {k: sum(r.metrics[k] * r.tokens for r in results) / max(tokens, 1) for k in results[0].metrics}
            return {"val_loss": loss, **{f"val_{k}": v for k, v in means.items()}}
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0))}

    def fit(self, on_step: Callable[[int], None] | None = None,
            on_grads: Callable[[int], None] | None = None) -> list[float]:
        """Train for train.steps optimizer steps; return the per-step losses (the same on every rank).
        `on_grads(step)` runs once the step's gradients are final and synchronised, before clipping; `on_step(step)`
        runs after each optimizer step (tests use both to inspect gradients and weights). SIGINT/SIGTERM (agreed by
        every rank in the step's vote) end the loop after that step: it is saved where checkpointing is on, and
        Interrupted carries the exit status (130/143)."""
        cfg, steps = self.cfg, self.cfg.train.steps
        first = self.checkpoints.resume()
        header = (run_header(cfg, self.data, self.grid.dp, self.grid.world_size, first, self.checkpoints.resumed_from)
                  if self.grid.rank == 0 else ())
        metrics = MetricsLogger(self.run_dir, cfg, enabled=self.grid.rank == 0, start_step=first,
                                device=self.grid.device, header=header)
        losses: list[float] = []
        unlabeled: list[int] = []  # steps whose samples held no label token on any rank: they train on nothing
        guard = self.guard
        # The same Parameter objects all run (resuming loads in place): list them once, not twice per step.
        params, norm_params = self.engine.parameters(), self.engine.norm_parameters()
        stopped: int | None = None  # the step after which SIGINT/SIGTERM stopped the run
        saved: Path | None = None
        try:
            for step, micro_batches in zip(range(first, steps), self.data):
                guard.begin(step + 1)
                lr = lr_at(step, steps, cfg.optim)
                set_lr(self.optimizer, lr)
                start = time.perf_counter()
                traced = step + 1 == cfg.train.trace_step
                if self.expert_load is not None:
                    self.expert_load.reset()
                if self.grpo is not None:  # the prompts' completions, scored, with their payload
                    micro_batches = self.grpo.prepare(step + 1, micro_batches)
                result = self.engine.step(with_inputs(micro_batches) if self.distill else micro_batches, trace=traced)
                rollout = self.grpo.after_step(step + 1, result) if self.grpo is not None else {}
                result.loss = guard.after_engine(step + 1, result.loss, params)
                if result.tokens == 0:
                    unlabeled.append(step + 1)
                    if len(unlabeled) == 1 and self.grid.rank == 0:
                        log.warning(no_label_warning(unlabeled, cfg))
                if on_grads is not None:
                    on_grads(step + 1)
                grad_norm = clip_grad_norm(params, norm_params, cfg.train.grad_clip, self.grid.mp_group,
                                           self.grid.device)
                if guard.should_step(step + 1, result.loss, grad_norm):  # skip: same on every rank
                    self.optimizer.step()
                grad_norm = guard.grad_norm  # the vote read the device's norm back with its flags: no read of its own
                self.optimizer.zero_grad(set_to_none=True)
                step_time = time.perf_counter() - start
                if step == first and self.compile_mode != "off" and self.grid.rank == 0:  # compiled at the first call
                    log.info("train.compile: the first step took %.1f s, compiling each decoder layer", step_time)
                choice = None
                if self.compile_trial is not None and self.compile_trial.choice is None:
                    guard.comparing_compiled(step + 1)
                    choice = self.compile_trial.after_step(step_time)
                if choice is not None and self.grid.rank == 0:  # every rank made it (one all-reduce of the times)
                    log.info(choice.line())
                losses.append(result.loss)
                if on_step is not None:
                    on_step(step + 1)
                tokens_per_s = self.tokens_per_step / step_time  # every token computed, padding included
                metrics.advance(1, {"loss": f"{result.loss:.4f}", "lr": f"{lr:.2e}", "tokens/s": f"{tokens_per_s:.0f}"})
                evaluated = self.val_batches is not None and ((step + 1) % cfg.train.eval_every == 0
                                                              or step + 1 == steps)
                if traced or evaluated or step == 0 or (step + 1) % cfg.train.log_every == 0 or step + 1 == steps:
                    # Only a logged step builds its record (and pays the trace files and the memory collective).
                    record = {"loss": result.loss, "aux_loss": result.aux_loss, "lr": lr, "grad_norm": grad_norm,
                              "pairs" if self.dpo else "completions" if self.grpo else "tokens": result.tokens,
                              "tokens_per_s": tokens_per_s,
                              "step_time_s": step_time, "skipped_steps": guard.skipped, **result.metrics, **rollout}
                    if not (self.dpo or self.grpo):  # their `tokens` count pairs and completions, not label tokens
                        record["label_tokens_per_s"] = result.tokens / step_time
                    if result.trace is not None:
                        record["bubble_fraction"] = write_trace(self.run_dir, step + 1, result.trace,
                                                                self.engine.simulated_step)
                    if evaluated:
                        guard.evaluating(step + 1)
                        record.update(self.evaluate())
                    if step == 0 and self.data.skipped_lines:
                        record["skipped_lines"] = self.data.skipped_lines
                    guard.logging(step + 1)
                    record.update(peak_memory_record(world_group(self.grid), self.grid.device))  # collective
                    if self.expert_load is not None:  # collective
                        record.update(self.expert_load.record(world_group(self.grid), self.grid.tp_rank))
                    if traced:  # the cost model's prediction next to the measurement
                        record.update(prediction_record(cfg, self.grid, record))
                    metrics.log(step + 1, record)
                guard.checkpointing(step + 1)
                self.checkpoints.after_step(step + 1)
                guard.end(step + 1)
                if guard.stop_signal and step + 1 < steps:  # at the last step the run simply ends
                    stopped = step + 1
                    break
            if stopped is not None:
                saved = self.save_interrupted(stopped)
            else:
                self.checkpoints.finish(max(first, steps))
            if len(unlabeled) > 1 and self.grid.rank == 0:
                log.warning(no_label_warning(unlabeled, cfg, of=(stopped or steps) - first))
        finally:
            metrics.close(signal.Signals(guard.stop_signal).name if stopped is not None else None)
        if stopped is not None:
            self.leave_interrupted(stopped, guard.stop_signal, saved)
        return losses

    def save_interrupted(self, step: int) -> Path | None:
        """The checkpoint of `step` after SIGINT/SIGTERM (every rank), unless checkpointing is off
        (checkpoint.every=0 and checkpoint.save_final=false); returns it."""
        self.guard.saving_on_interrupt()
        spec = self.checkpoints.spec
        if spec.every <= 0 and not spec.save_final:
            return None
        self.checkpoints.save(step)  # nothing to do when checkpoint.every saved this step already
        return find_checkpoint(spec.dir)

    def leave_interrupted(self, step: int, signo: int, saved: Path | None) -> None:
        """Rank 0 says what was saved and how to resume; every rank waits for that, then raises Interrupted."""
        name = signal.Signals(signo).name
        if saved is not None:
            line = (f"interrupted by {name} at step {step}: saved checkpoint step {step} to {saved}; resume with: "
                    f"{resume_command(self.run_dir, dict(os.environ), sys.argv)}")
        else:
            line = (f"interrupted by {name} at step {step}: nothing was saved (checkpoint.every=0 and "
                    "checkpoint.save_final=false); set checkpoint.save_final=true or checkpoint.every=N to save "
                    "when interrupted")
        if self.grid.rank == 0:
            tqdm.write(f"sluice: {line}", file=sys.stderr)
            sys.stderr.flush()
        if self.grid.world_size > 1:  # no rank exits (and has its launcher stop the others) before rank 0 spoke
            self.guard.watch.collective(f"after step {step}: leaving on {name}", "world")
            dist.barrier()
        raise Interrupted(exit_code(signo))
