"""How faithfully a run's optimizers and target update follow float64, on the run's own gradients.

Loads a run's ``last.ckpt`` (weights, optimizer state, loss scales, the target critic, the update
count) and the replay buffer saved beside it, and takes ``--updates`` more updates as the run
would: its precision policy, its cadence of actor and target updates, real replay batches. Each
step of each optimizer is shadowed by float64 Adam, and each target update by a float64 EMA:

- float64 Adam starts from the run's moments in true (unscaled) units -- hAdam's
  ``m64 = m/S`` and ``v64 = (s/(c·S))²`` with ``c = (1-β1)/sqrt(1-β2)`` and ``S`` the loss's
  scale; torch Adam's ``exp_avg`` and ``exp_avg_sq`` as they are -- and its own weights from the
  run's (``p - c`` where a Kahan buffer holds what ``p`` lost);
- it is fed the very gradient the run's optimizer received, divided by ``S`` in float64, and
  skips the steps the run skipped; its ε is the run's in true units (hAdam: ``ε/(c·S)``, which
  is what hAdam amounts to in exact arithmetic);
- the target's judge is ``θ̄64 <- θ̄64 + τ(θ - θ̄64)`` of the critic weights the run's target
  update read, compared with the run's target as its compensated sum holds it
  (``(θ̄_S - c)/K_i``).

So the gradients are the run's own and only the optimizers' and the target's arithmetic is on
trial. Per optimizer (critic, actor, temperature) it reports:

- ``step error``: ‖u - Δθ64‖ / ‖Δθ64‖, where ``u`` is the Adam step the run's moments call for
  just after its step (its stored ``m``, ``s`` or ``v`` and ``t`` through Adam's formula in
  float64), its mean over the steps taken, and ``step ratio`` ‖u‖ / ‖Δθ64‖ (above 1: the run's
  moments step further than Adam's). This leaves out how the weight is written: stochastic
  rounding (fp16's default) lands each sub-ulp step on a neighbouring 16-bit value, right on
  average but not step by step, which the path error takes in;
- ``path error``: ‖θ - θ64‖ / ‖θ64 - θ0‖ after the updates, θ64 moved by its own steps, also
  within the smallest tenth, the middle and the largest tenth of the elements (below): against
  the updates taken, an unbiased error (a noisy moment, stochastically rounded weights) grows
  like the square root of their number where float64's own path grows like the number, so its
  ratio falls; a systematic one (a moment that drifts) holds or grows;
- the first moment ``‖m/S - m64‖ / ‖m64‖`` and the root moment ``s/(c·S·sqrt(v64))`` (torch
  Adam: ``sqrt(exp_avg_sq / v64)``) as its median over the elements, also within the smallest
  tenth, the middle and the largest tenth of the elements by ``sqrt(v64)`` -- where a gradient
  element is small, a 16-bit moment in ×S units sits near the subnormals -- and the share of
  elements whose ``m`` or ``s`` is exactly 0 while float64's is not, and ``m frozen``: the share
  whose 16-bit ``m`` is too small to decay at all (``RN(β1·m) = m``, a few subnormal ulps).
  With ``m`` stochastically rounded (``lowp.stochastic_first_moment``), an ``m`` below one
  subnormal ulp is 0 most of the time and one ulp otherwise, unbiased on average: most of
  ``m lost`` is then those zeros, not a lost signal, and ``m frozen`` counts states that
  rounding to nearest could not leave but a stochastic rounding does;
- the last step's ratio ‖u‖ / ‖Δθ64‖ within those tenths;
- for the target: ‖θ̄ - θ̄64‖ / ‖θ̄64 - θ̄0‖ (0: the target moved exactly as a float64 EMA of the
  same weights would).

``--variant NAME="key=value ..."`` continues from the same state with other numerics of the same
precision (e.g. ``lowp.unbiased_moments=false``, the published hAdam); each contender then takes
its own path, judged against its own gradients. The batches, augmentation shifts and policy
noise are the same for every contender. A variant may also move a loss's compound scale,
``loss_scale.critic=4.8828125``: the run's ``S`` times a power of two ``f``, applied as a backoff
or a growth applies it (``S``, the moments and ε times ``f``, each rounded once into its dtype), so
the same weights and moments in true units go on at another ``S`` -- where a sunk scale would
have left them. Add ``lowp.growth_interval=1000000`` to keep it there.

    python tools/fidelity.py step RUN_DIR --updates 500 --report-every 100 --out OUT
    python tools/fidelity.py step RUN_DIR --variant "low=loss_scale.critic=4.8828125 lowp.growth_interval=1000000"
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from table_files import write_table_files

from judges.common import RunUnreadable, driven_by_fabric, flat, load_run
from pixelsac import checkpoint as ckpt_io
from pixelsac.config import ConfigError, load_config, parse_overrides, to_plain
from pixelsac.lowp import CompoundLossScaler, rescale_optimizer_state_
from pixelsac.module import LOSSES, SACModule

#: A param group's keys that say how it steps (the variant's win); its lr, betas and ε (rescaled
#: with the loss scale under compound scaling) come from the checkpoint.
GROUP_SWITCHES = (
    "kahan",
    "unbiased_moments",
    "stochastic_first_moment",
    "foreach",
    "fused",
    "capturable",
    "differentiable",
)
_ABSENT = object()
TENTHS = ("smallest tenth", "middle", "largest tenth")


class AdamJudge:
    """Float64 Adam over one optimizer's parameters (flat), in true gradient units.

    ``scale_of()`` gives the loss's current scale S (1.0 without compound scaling)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        raw: torch.optim.Optimizer,
        scale_of: Callable[[], float],
        names: list[str] | None = None,
    ) -> None:
        self.params, self.raw, self.scale_of = params, raw, scale_of
        self.names = names or [f"param {i}" for i in range(len(params))]
        group = raw.param_groups[0]
        self.beta1, self.beta2 = group["betas"]
        self.lr = float(group["lr"])
        self.taken = 0  # steps taken since the checkpoint
        self.step_errors: list[float] = []
        self.step_ratios: list[float] = []
        self.last: dict[str, torch.Tensor] = {}  # the last step taken: the run's and float64's
        self._before: dict[str, Any] = {}
        states = [self.raw.state.get(p, {}) for p in self.params]
        self.rooted = any("exp_avg_root" in s for s in states)
        self.root_factor = (1 - self.beta1) / math.sqrt(1 - self.beta2)  # hAdam's c
        self.theta = self.effective().clone()
        self.start = self.theta.clone()
        scale = self.scale_of()
        self.exp_avg, self.exp_avg_sq = self._run_moments(scale)
        self.steps = self._run_steps()

    def effective(self) -> torch.Tensor:
        """The run's weights as its arithmetic holds them: ``p - c`` where a Kahan buffer keeps
        what rounding ``p`` lost (kahan.py), else ``p``."""
        parts = []
        for p in self.params:
            value = p.detach().double()
            comp = self.raw.state.get(p, {}).get("kahan_comp")
            parts.append((value - comp.double() if comp is not None else value).reshape(-1))
        return torch.cat(parts)

    def _run_moments(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's first and second moment in float64 and true units (zeros before a first step)."""
        first, second = [], []
        for p in self.params:
            state = self.raw.state.get(p, {})
            if "exp_avg" not in state:
                first.append(torch.zeros(p.numel(), dtype=torch.float64))
                second.append(torch.zeros(p.numel(), dtype=torch.float64))
                continue
            first.append(state["exp_avg"].double().reshape(-1) / scale)
            if self.rooted:
                second.append((state["exp_avg_root"].double().reshape(-1) / (self.root_factor * scale)).square())
            else:
                second.append(state["exp_avg_sq"].double().reshape(-1))
        return torch.cat(first), torch.cat(second)

    def _run_steps(self) -> int:
        counts = {int(float(s["step"])) for p in self.params if "step" in (s := self.raw.state.get(p, {}))}
        return max(counts, default=0)

    def true_eps(self, scale: float) -> float:
        eps = float(self.raw.param_groups[0]["eps"])
        return eps / (self.root_factor * scale) if self.rooted else eps

    # --- the optimizer's step hooks ---------------------------------------------------------------
    def before_step(self, *_: Any) -> None:
        scale = self.scale_of()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self._before = {
            "theta": self.effective(),
            "grad": flat(grads) / scale,
            "scale": scale,
            "eps": self.true_eps(scale),
            "steps": self._run_steps(),
        }

    def after_step(self, *_: Any) -> None:
        before = self._before
        if not before or self._run_steps() == before["steps"]:
            return  # skipped (overflow): float64 skips it too
        grad = before["grad"]
        self.steps += 1
        self.taken += 1
        self.exp_avg.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        judge_step = self.adam_step(self.exp_avg, self.exp_avg_sq, self.steps, before["eps"])
        self.theta.add_(judge_step)
        self._before = {}
        scale = self.scale_of()
        if scale != before["scale"]:
            return  # the scaler rescaled S, m and s around this step: their units need not agree yet
        run_first, run_second = self._run_moments(scale)
        run_step = self.adam_step(run_first, run_second, self._run_steps(), self.true_eps(scale))
        norm = float(judge_step.norm())
        if norm > 0:
            self.step_errors.append(float((run_step - judge_step).norm()) / norm)
            self.step_ratios.append(float(run_step.norm()) / norm)
        self.last = {"run_step": run_step, "judge_step": judge_step}

    def adam_step(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
        """Adam's step ``-lr/(1-β1^t) · m / (sqrt(v/(1-β2^t)) + ε)`` in float64."""
        denom = (exp_avg_sq / (1 - self.beta2**steps)).sqrt_().add_(eps)
        return -self.lr / (1 - self.beta1**steps) * exp_avg / denom

    def error_by_tensor(self) -> dict[str, float]:
        """Each tensor's ‖u - Δθ64‖ on the last step, as a share of float64's whole step."""
        run, judged = self.last["run_step"], self.last["judge_step"]
        whole = float(judged.norm())
        shares, start = {}, 0
        for name, p in zip(self.names, self.params, strict=True):
            part = slice(start, start + p.numel())
            start += p.numel()
            shares[name] = float((run[part] - judged[part]).norm()) / whole if whole > 0 else math.nan
        return shares

    def frozen_first_moment(self) -> float:
        """The share of elements whose stored ``m`` is not 0 and rounds back to itself after a
        step with a zero gradient (``RN(β1·m) = m``): in the subnormals, where a decay of 1-β1 is
        below half an ulp, such an ``m`` stays put until a gradient moves it, while float64's
        decays to 0."""
        frozen = total = 0
        for p in self.params:
            exp_avg = self.raw.state.get(p, {}).get("exp_avg")
            total += p.numel()
            if exp_avg is not None:
                decayed = (exp_avg.float() * self.beta1).to(exp_avg.dtype)
                frozen += int(((exp_avg != 0) & (decayed == exp_avg)).sum())
        return frozen / max(total, 1)

    # --- what the report reads ------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        scale = self.scale_of()
        run_first, run_second = self._run_moments(scale)
        theta = self.effective()
        moved = float((self.theta - self.start).norm())
        row: dict[str, Any] = {
            "steps taken": self.taken,
            "step error": float(np.mean(self.step_errors)) if self.step_errors else math.nan,
            "step ratio": float(np.mean(self.step_ratios)) if self.step_ratios else math.nan,
            "path error": float((theta - self.theta).norm()) / moved if moved > 0 else math.nan,
            "first moment error": float((run_first - self.exp_avg).norm() / self.exp_avg.norm().clamp_min(1e-300)),
            "loss scale": scale,
        }
        judge_root = self.exp_avg_sq.sqrt()
        live = judge_root > 0
        ratio = run_second[live].sqrt() / judge_root[live]
        row["root ratio"] = float(ratio.median()) if ratio.numel() else math.nan
        row["m lost"] = float(((run_first == 0) & (self.exp_avg != 0)).double().mean())
        row["s lost"] = float(((run_second == 0) & live).double().mean())
        row["m frozen"] = self.frozen_first_moment()
        if ratio.numel() >= 10:
            roots = judge_root[live]
            low, high = np.quantile(roots.numpy(), [0.1, 0.9])
            bins = {
                "smallest tenth": roots <= low,
                "middle": (roots > low) & (roots < high),
                "largest tenth": roots >= high,
            }
            steps = {k: v[live] for k, v in self.last.items()}
            off_path, own_path = (theta - self.theta)[live], (self.theta - self.start)[live]
            whole = float(steps["judge_step"].norm()) if steps else 0.0
            for name, chosen in bins.items():
                row[f"root ratio, {name}"] = float(ratio[chosen].median()) if chosen.any() else math.nan
                moved_here = float(own_path[chosen].norm())
                row[f"path error, {name}"] = float(off_path[chosen].norm()) / moved_here if moved_here > 0 else math.nan
                if steps:
                    run, judged = steps["run_step"][chosen], steps["judge_step"][chosen]
                    norm = float(judged.norm())
                    row[f"last step ratio, {name}"] = float(run.norm()) / norm if norm > 0 else math.nan
                    # how much of float64's step, and of the step error, lies in this tenth
                    row[f"last step share, {name}"] = norm / whole if whole > 0 else math.nan
                    missed = float((run - judged).norm())
                    row[f"last step error share, {name}"] = missed / whole if whole > 0 else math.nan
        if self.last:
            row["last step error by tensor"] = self.error_by_tensor()
        return row


class TargetJudge:
    """A float64 EMA of the critic weights the run's target update reads."""

    def __init__(self, module: SACModule) -> None:
        self.updater = module.target_updater
        self.sources = [p for _, p in self.updater.source.named_parameters()]
        self.theta = self.effective().clone()
        self.start = self.theta.clone()
        self.updates = 0
        original = self.updater.update_

        def update_(tau: float) -> None:
            read = flat(self.sources)
            original(tau)
            self.theta.add_(read - self.theta, alpha=tau)
            self.updates += 1

        self.updater.update_ = update_  # the module calls its updater's update_ by attribute

    def effective(self) -> torch.Tensor:
        """θ̄ as the run holds it: ``(θ̄_S - c)/K_i`` of Kahan-momentum's compensated scaled copy,
        else the stored target's weights."""
        updater = self.updater
        if updater.compensated and updater.param_names:
            scaled, comps = updater._buffers_in_order()
            scales = updater.tensor_scales().double().tolist()
            return torch.cat(
                [((s.double() - c.double()) / k).reshape(-1) for s, c, k in zip(scaled, comps, scales, strict=True)]
            )
        return flat(updater.target_parameters())

    def report(self) -> dict[str, Any]:
        moved = float((self.theta - self.start).norm())
        error = float((self.effective() - self.theta).norm())
        return {"target updates": self.updates, "path error": error / moved if moved > 0 else math.nan}


def resume(run_dir: Path, overrides: list[str]) -> tuple[Any, Any, dict[str, Any]]:
    """The run as its trainer would resume it (weights, optimizer state, scalers, update count),
    in one CPU process driven through Lightning Fabric, with ``overrides`` on its config: Fabric's
    wrapper of the :class:`SACModule` (``.module``), the replay and the checkpoint."""
    if not (run_dir / "checkpoints").is_dir():
        raise UnfitState(f"{run_dir} is not a run directory (no checkpoints/ in it); give the directory a run wrote")
    try:
        _, replay, checkpoint = load_run(run_dir)
    except RunUnreadable as exc:
        raise UnfitState(str(exc)) from None
    checkpoint = copy.copy(checkpoint)
    moved = {k[len(SCALE_KEY) :]: v for k, v in parse_overrides(overrides).items() if k.startswith(SCALE_KEY)}
    overrides = [o for o in overrides if not o.startswith(SCALE_KEY)]
    if overrides:
        # the saved config with the keys added since it was written, as a resume reads it
        config = OmegaConf.create(to_plain(load_config([], base=checkpoint["hyper_parameters"]["config"])))
        for key, value in parse_overrides(overrides).items():
            if key == "precision" or key.startswith(("agent.", "env.")):
                raise UnfitState(f"a variant continues the run's state, so it cannot change {key}; lowp.* keys can")
            if OmegaConf.select(config, key, default=_ABSENT) is _ABSENT:
                raise UnfitState(f"the run's config has no key {key!r} (a variant changes keys it has)")
            OmegaConf.update(config, key, value)
        checkpoint["hyper_parameters"] = {**checkpoint["hyper_parameters"], "config": OmegaConf.to_container(config)}
    saved = checkpoint.get("optimizer_states", [])

    def load_states(optimizers: list[Any]) -> None:
        if len(saved) != len(optimizers):
            raise UnfitState(f"{run_dir}'s checkpoint holds {len(saved)} optimizer states, not {len(optimizers)}")
        for optimizer, state in zip(optimizers, saved, strict=True):
            # the variant's numerics, not the checkpoint's: load_state_dict would restore its groups' switches
            built = [{key: group[key] for key in GROUP_SWITCHES if key in group} for group in optimizer.param_groups]
            try:
                optimizer.load_state_dict(state)
                for group, switches in zip(optimizer.param_groups, built, strict=True):
                    group.update(switches)
            except (ValueError, KeyError, RuntimeError) as exc:
                raise UnfitState(
                    f"the run's optimizer state does not fit {' '.join(overrides) or 'its own config'} "
                    f"({ckpt_io.first_line(exc)}); a variant may change numerics, not the precision or the networks"
                ) from exc

    module = driven_by_fabric(SACModule.from_checkpoint(checkpoint).train(), load_states)
    inner = module.module
    for name, scaler_state in inner._pending_scaler_states.items():  # what on_fit_start does under a Trainer
        if inner.scalers.get(name) is not None:
            inner.scalers[name].load_state_dict(scaler_state)
    inner._pending_scaler_states = {}
    for name, scale in moved.items():
        move_loss_scale(inner, name, scale)
    return module, replay, checkpoint


#: A variant's key that moves a loss's compound scale (``loss_scale.critic=4.8828125``).
SCALE_KEY = "loss_scale."


def move_loss_scale(inner: Any, name: str, scale: Any) -> None:
    """Put loss ``name``'s compound scale at ``scale`` = ``S·f``, ``f`` a power of two, as the
    scaler's backoff or growth would: ``S``, the optimizer's moments (hAdam: ``m``, ``s``; Adam:
    ``m``, ``v·f²``) and ε times ``f``, each rounded once into its dtype."""
    optimizers = dict(zip(LOSSES, inner.optimizers(), strict=True))
    if name not in optimizers:
        raise UnfitState(f"{SCALE_KEY}{name}: the losses are {', '.join(LOSSES)}")
    scaler = inner.scalers.get(name)
    if not isinstance(scaler, CompoundLossScaler):
        raise UnfitState(f"{SCALE_KEY}{name}: the run's {name} loss has no compound loss scale to move")
    try:
        scale = float(scale) if not isinstance(scale, bool) else math.nan  # YAML reads 1e4 as a string
    except (TypeError, ValueError):
        scale = math.nan
    if not 0 < scale < math.inf:
        raise UnfitState(f"{SCALE_KEY}{name} takes a positive number")
    factor = scale / float(scaler.scale)
    if math.frexp(factor)[0] != 0.5:
        raise UnfitState(
            f"{SCALE_KEY}{name}={scale:g} is not the run's scale {float(scaler.scale):g} times a power of 2, "
            "so the moments could not move exactly with it"
        )
    optimizer = optimizers[name]
    rescale_optimizer_state_(getattr(optimizer, "optimizer", optimizer), factor, scaler.eps_floor)
    scaler.load_state_dict({**scaler.state_dict(), "scale": scale})


class UnfitState(Exception):
    """The run cannot be continued as asked (no replay saved, a variant whose state does not fit)."""


class Contender:
    """One module continuing the run, its optimizers and target shadowed by float64."""

    def __init__(self, module: Any) -> None:
        self.module = module
        inner = getattr(module, "module", module)
        self.inner = inner
        self.judges: dict[str, AdamJudge] = {}
        for name, optimizer in zip(LOSSES, inner.optimizers(), strict=True):
            raw = getattr(optimizer, "optimizer", optimizer)
            params = [p for group in raw.param_groups for p in group["params"]]
            names = {id(p): n for n, p in inner.named_parameters()}
            judge = AdamJudge(params, raw, self._scale_of(name), [names.get(id(p), "?") for p in params])
            raw.register_step_pre_hook(judge.before_step)
            raw.register_step_post_hook(judge.after_step)
            self.judges[name] = judge
        self.target = TargetJudge(inner)

    def _scale_of(self, name: str) -> Callable[[], float]:
        def scale() -> float:
            # compound scaling hands hAdam S·g; torch's GradScaler unscales before the step
            scaler = self.inner.scalers.get(name)
            return float(scaler.scale) if isinstance(scaler, CompoundLossScaler) else 1.0

        return scale

    def update(self, batch: dict[str, torch.Tensor]) -> None:
        self.inner.training_step(iter([(batch, 0, 0)]))

    def rows(self, label: str, updates: int) -> list[dict[str, Any]]:
        rows = [{"variant": label, "updates": updates, "optimizer": n, **j.report()} for n, j in self.judges.items()]
        rows.append({"variant": label, "updates": updates, "optimizer": "target critic", **self.target.report()})
        return rows


def _cell(value: Any, digits: str = ".4f") -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else format(value, digits)
    return "–" if value is None else str(value)


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    last = max(r["updates"] for r in rows)
    final = [r for r in rows if r["updates"] == last]
    lines = [
        header,
        "",
        "| variant | optimizer | steps taken | step error | step ratio | path error | m error | root ratio "
        "| root ratio: smallest / middle / largest tenth | last step ratio: smallest / middle / largest tenth "
        "| path error: smallest / middle / largest tenth | m lost | s lost | m frozen | loss scale |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in final:
        if r["optimizer"] == "target critic":
            lines.append(
                f"| {r['variant']} | target critic | {r['target updates']} | | | {_cell(r['path error'], '.3g')} "
                "| | | | | | | | | |"
            )
            continue
        tenths = " / ".join(_cell(r.get(f"root ratio, {t}"), ".3f") for t in TENTHS)
        steps = " / ".join(_cell(r.get(f"last step ratio, {t}"), ".3f") for t in TENTHS)
        paths = " / ".join(_cell(r.get(f"path error, {t}"), ".3g") for t in TENTHS)
        lines.append(
            f"| {r['variant']} | {r['optimizer']} | {r['steps taken']} | {_cell(r['step error'], '.3g')} "
            f"| {_cell(r['step ratio'])} | {_cell(r['path error'], '.3g')} | {_cell(r['first moment error'], '.3g')} "
            f"| {_cell(r['root ratio'])} | {tenths} | {steps} | {paths} | {_cell(r['m lost'], '.2e')} "
            f"| {_cell(r['s lost'], '.2e')} | {_cell(r.get('m frozen'), '.2e')} | {r['loss scale']:g} |"
        )
    located = [r for r in final if "last step error by tensor" in r]
    if located:
        lines += [
            "",
            "Where the last step's error lies, as shares of float64's whole step ‖Δθ64‖: float64's step and the "
            "error ‖u − Δθ64‖ within each tenth of the elements by float64's sqrt(v), and the tensors with the "
            "largest error:",
            "",
            "| variant | optimizer | float64's step: smallest / middle / largest tenth "
            "| error: smallest / middle / largest tenth | largest errors by tensor |",
            "|---|---|---|---|---|",
        ]
        for r in located:
            share = " / ".join(_cell(r.get(f"last step share, {t}"), ".3g") for t in TENTHS)
            error = " / ".join(_cell(r.get(f"last step error share, {t}"), ".3g") for t in TENTHS)
            ranked = sorted(r["last step error by tensor"].items(), key=lambda kv: -kv[1])[:3]
            tensors = ", ".join(f"`{name}` {value:.3g}" for name, value in ranked)
            lines.append(f"| {r['variant']} | {r['optimizer']} | {share} | {error} | {tensors} |")
    by_point = sorted({r["updates"] for r in rows})
    if len(by_point) > 1:
        names = sorted({r["variant"] for r in rows}, key=[r["variant"] for r in rows].index)
        lines += [
            "",
            "Path error by updates taken (‖θ − θ64‖ / ‖θ64 − θ0‖):",
            "",
            "| variant | optimizer | " + " | ".join(str(u) for u in by_point) + " |",
            "|---|---|" + "---|" * len(by_point),
        ]
        for name in names:
            for opt in (*LOSSES, "target critic"):
                cells = [
                    _cell(
                        next(r["path error"] for r in rows if (r["variant"], r["optimizer"], r["updates"]) == key),
                        ".3g",
                    )
                    for key in ((name, opt, u) for u in by_point)
                ]
                lines.append(f"| {name} | {opt} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Path error in the smallest tenth of the elements by float64's sqrt(v), by updates taken (falling: "
            "noise that averages out; holding or growing: drift):",
            "",
            "| variant | optimizer | " + " | ".join(str(u) for u in by_point) + " |",
            "|---|---|" + "---|" * len(by_point),
        ]
        for name in names:
            for opt in LOSSES:
                found = [
                    next((r for r in rows if (r["variant"], r["optimizer"], r["updates"]) == (name, opt, u)), {})
                    for u in by_point
                ]
                if any("path error, smallest tenth" in r for r in found):
                    cells = [_cell(r.get("path error, smallest tenth"), ".3g") for r in found]
                    lines.append(f"| {name} | {opt} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/fidelity.py step", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--report-every", type=int, default=0, help="also report after every N updates")
    parser.add_argument("--seed", type=int, default=0, help="picks the replay batches and the updates' random draws")
    parser.add_argument("--variant", action="append", default=[], help='NAME="key=value ..." (repeatable)')
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if args.updates < 1 or args.report_every < 0:
        parser.error("--updates must be positive and --report-every not negative")
    torch.set_num_threads(1)
    specs = {"as trained": []}
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        if not name or not overrides.strip():
            parser.error(f'--variant takes NAME="key=value ...", not {spec!r}')
        specs[name] = overrides.split()
    contenders: dict[str, Contender] = {}
    replay = None
    try:
        for name, overrides in specs.items():
            module, replay, _ = resume(args.run_dir, overrides)
            contenders[name] = Contender(module)
    except (OSError, ckpt_io.CheckpointError, ConfigError, UnfitState) as exc:
        print(f"error: {ckpt_io.first_line(exc)}", file=sys.stderr)
        return 2
    first = next(iter(contenders.values())).inner
    start_updates = first.updates
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    for update in range(1, args.updates + 1):
        batch = replay.sample(first.cfg.agent.batch_size, rng)
        for contender in contenders.values():
            torch.manual_seed(args.seed * 1_000_003 + update)  # the same shifts and noise for every contender
            contender.update(batch)
        if update == args.updates or (args.report_every and update % args.report_every == 0):
            for name, contender in contenders.items():
                rows.extend(contender.rows(name, update))
            print(f"{update} updates: " + ", ".join(
                f"{r['variant']}/{r['optimizer']} path {r['path error']:.4f}" for r in rows[-4 * len(contenders):]
            ), flush=True)  # fmt: skip
    header = (
        f"Run {args.run_dir.name} ({first.precision_policy.mode}, from update {start_updates}), {args.updates} more "
        "updates on its replay; each optimizer's steps against float64 Adam fed the same gradients, the target "
        "against a float64 EMA of the same weights."
    )
    table = markdown(rows, header)
    print(table)
    if args.out:
        write_table_files(args.out, "fidelity.py step", argv, table, {"start_updates": start_updates, "rows": rows})
    return 0
