"""Alert rules over the metric stream, each with severity, window, cool-down and hysteresis.

Every rule reduces an observation to "bad or not" (or "no opinion yet"); the
shared `Rule.observe` turns that into at most one alert per episode:

- window: the condition must have held for `window` steps before the rule fires
  (measured in training steps, so it does not depend on `train.log_interval`;
  grad_spike and loss_rising fire on sight, their window is inside the statistic);
- hysteresis: after firing, the rule stays latched until the condition has been
  false for `window` steps, so a condition that flickers fires once;
- cool-down: no second firing within `cooldown` steps of the last one.

Statistics (stated, so a reader can judge them):
- non_finite: loss or grad norm is NaN or infinite (on any rank: `non_finite`
  counts the ranks, trainlab.train.loop.metrics).
- loss_rising: the moving average of the loss over the last `smoothing` steps has
  risen over the last `window` steps by more than RISE_Z standard errors (the noise
  of one loss value is estimated from successive differences). Requiring a rise at
  every single observation instead would be a coin flip per observation on a flat,
  noisy curve, and false alarms with a sparse `train.log_interval`.
- grad_spike: grad norm > `factor` x the mean grad norm of the previous `window`
  steps (spikes themselves are left out of the mean); fires on sight.
- throughput_drop: tokens/s < `fraction` x the median tokens/s of the last
  THROUGHPUT_HISTORY healthy observations, for `window` steps.
- stale_checkpoint: the newest valid checkpoint (or the run start, before the
  first one) is older than `minutes`.
- expert_imbalance (MoE): some layer's busiest expert > `factor` x the mean load,
  or more than `dead_fraction` of its experts got no token, at the logged step
  (trainlab.models.moe.metrics), for `window` steps.
- router_collapse (MoE): some layer's top_k busiest experts take >= `share` of
  its assignments, for `window` steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

# Rules judged on every step's signals (the loop's on_step_signals); the others on
# the logged windows (throughput, checkpoint age, disk).
STEP_RULES = ("non_finite", "loss_rising", "grad_spike")

# Observations a statistic needs before it judges anything.
MIN_HISTORY = 3
THROUGHPUT_HISTORY = 50
# loss_rising: a rise counts when it exceeds this many standard errors of the noise.
RISE_Z = 5.0
NOISE_HISTORY = 200


@dataclass(frozen=True)
class Alert:
    rule: str
    severity: str
    step: int
    value: float
    message: str
    run: str = ""
    run_id: str | None = None
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict; a non-finite value is given as the string "nan", "inf" or "-inf"."""
        d = asdict(self)
        if not math.isfinite(self.value):
            d["value"] = str(self.value)
        return d


@dataclass
class Verdict:
    """One rule's view of one observation."""

    bad: bool
    value: float
    message: str = ""


@dataclass
class Rule:
    """Latching, cool-down and windowing shared by all rules; subclasses judge."""

    name: str
    severity: str
    window: int
    cooldown: int
    enabled: bool = True
    _prev_step: int | None = field(default=None, repr=False)
    _bad_since: int | None = field(default=None, repr=False)
    _good_since: int | None = field(default=None, repr=False)
    _latched: bool = field(default=False, repr=False)
    _last_fired: int | None = field(default=None, repr=False)

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        """Bad or not at this observation; None when there is nothing to judge yet."""
        raise NotImplementedError

    @property
    def hold_steps(self) -> int:
        """Steps the condition must hold before the rule fires."""
        return self.window

    @property
    def rearm_steps(self) -> int:
        """Steps the condition must be absent before a fired rule can fire again."""
        return self.window

    def observe(self, step: int, metrics: dict[str, float], now: float) -> Alert | None:
        if not self.enabled:
            return None
        verdict = self.judge(step, metrics, now)
        # A condition seen now has held since just after the previous observation.
        since = step if self._prev_step is None else self._prev_step + 1
        self._prev_step = step
        if verdict is None:
            return None
        if verdict.bad:
            self._good_since = None
            self._bad_since = since if self._bad_since is None else self._bad_since
            return self._maybe_fire(step, verdict, now)
        self._bad_since = None
        self._good_since = since if self._good_since is None else self._good_since
        if self._latched and step - self._good_since + 1 >= self.rearm_steps:
            self._latched = False
        return None

    def _maybe_fire(self, step: int, verdict: Verdict, now: float) -> Alert | None:
        held = step - self._bad_since + 1
        cooling = self._last_fired is not None and step - self._last_fired < self.cooldown
        if self._latched or held < self.hold_steps or cooling:
            return None
        self._latched = True
        self._last_fired = step
        return Alert(self.name, self.severity, step, verdict.value, verdict.message, time=now)


def _stdev(values: deque) -> float:
    # Plain float arithmetic: statistics.stdev is exact (Fractions) and 100x slower.
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _finite(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    if value is None or not math.isfinite(value):
        return None
    return float(value)


@dataclass
class NonFinite(Rule):
    keys: tuple[str, ...] = ("loss", "grad_norm")

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        seen = [(k, metrics[k]) for k in self.keys if metrics.get(k) is not None]
        if not seen:
            return None
        flagged = metrics.get("non_finite")
        if flagged:  # some rank's loss or grad norm (the all-reduced flags)
            return Verdict(
                True,
                float(flagged),
                f"non-finite loss/grad norm on {flagged:g} rank(s) at step {step}",
            )
        for key, value in seen:
            if not math.isfinite(value):
                return Verdict(True, float(value), f"{key} is {value} at step {step}")
        return Verdict(False, float(seen[0][1]))


@dataclass
class LossRising(Rule):
    smoothing: int = 20
    _recent: deque = field(default_factory=deque, repr=False)
    _averages: deque = field(default_factory=deque, repr=False)
    _diffs: deque = field(default_factory=lambda: deque(maxlen=NOISE_HISTORY), repr=False)

    @property
    def hold_steps(self) -> int:
        # The window is already inside the statistic (now vs `window` steps ago).
        return 1

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        loss = _finite(metrics, "loss")
        if loss is None:
            return None
        if self._recent:
            self._diffs.append(loss - self._recent[-1][1])
        self._recent.append((step, loss))
        while self._recent[0][0] <= step - self.smoothing:
            self._recent.popleft()
        n = len(self._recent)
        avg = sum(v for _, v in self._recent) / n
        self._averages.append((step, avg))
        earlier = None
        while self._averages[0][0] <= step - self.window:
            earlier = self._averages.popleft()
        if earlier is not None:  # keep the newest average at least `window` steps old
            self._averages.appendleft(earlier)
        if earlier is None or len(self._diffs) < MIN_HISTORY:
            return None
        # Noise of one loss value from successive differences (robust to slow trends),
        # then the standard error of the difference of two n-point averages.
        noise = _stdev(self._diffs) / math.sqrt(2)
        margin = RISE_Z * noise * math.sqrt(2 / n)
        rise = avg - earlier[1]
        return Verdict(
            rise > margin,
            avg,
            f"loss moving average ({self.smoothing} steps) rose by {rise:.4g} over "
            f"the last {step - earlier[0]} steps to {avg:.4g} (noise margin "
            f"{margin:.3g})",
        )


@dataclass
class GradSpike(Rule):
    factor: float = 10.0
    _history: deque = field(default_factory=deque, repr=False)

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        norm = _finite(metrics, "grad_norm")
        if norm is None:
            return None
        while self._history and self._history[0][0] <= step - self.window:
            self._history.popleft()
        if len(self._history) < MIN_HISTORY:
            self._history.append((step, norm))
            return None
        mean = sum(v for _, v in self._history) / len(self._history)
        spike = norm > self.factor * mean
        if not spike:  # a spike must not raise the bar for the next one
            self._history.append((step, norm))
        return Verdict(
            spike,
            norm,
            f"grad norm {norm:.4g} > {self.factor:g} x its running mean {mean:.4g} (step {step})",
        )

    @property
    def hold_steps(self) -> int:
        # A spike is an event, not a state: it fires on sight (window is the mean's span).
        return 1


@dataclass
class ThroughputDrop(Rule):
    fraction: float = 0.5
    _healthy: deque = field(default_factory=lambda: deque(maxlen=THROUGHPUT_HISTORY), repr=False)

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        tps = _finite(metrics, "tokens_per_s")
        if tps is None:
            return None
        if len(self._healthy) < MIN_HISTORY:
            self._healthy.append(tps)
            return None
        median = statistics.median(self._healthy)
        drop = tps < self.fraction * median
        if not drop:
            self._healthy.append(tps)
        return Verdict(
            drop,
            tps,
            f"tokens/s {tps:.4g} below {self.fraction:g} x its running "
            f"median {median:.4g} for {self.window}+ steps",
        )


@dataclass
class StaleCheckpoint(Rule):
    minutes: float = 30.0
    _last_valid: float | None = field(default=None, repr=False)

    def start(self, now: float) -> None:
        """The run (re)started: ages count from here until the first valid checkpoint."""
        self._last_valid = now

    def checkpoint_saved(self, now: float) -> None:
        self._last_valid = now

    def age_s(self, now: float) -> float | None:
        """Seconds since the newest valid checkpoint (or the start), by this rule's clock."""
        return None if self._last_valid is None else now - self._last_valid

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        age = _finite(metrics, "ckpt_age_s")
        if age is None:
            age = self.age_s(now)
        if age is None:
            return None
        return Verdict(
            age > self.minutes * 60,
            age,
            f"no valid checkpoint for {age / 60:.1f} min (limit {self.minutes:g} min)",
        )


@dataclass
class ExpertImbalance(Rule):
    """An MoE's router, sustained: the busiest expert gets more than `factor` x the
    mean load, or more than `dead_fraction` of the experts get no token, in some
    MoE layer (moe/load_max_over_mean, moe/dead_frac: trainlab.models.moe.metrics)."""

    factor: float = 3.0
    dead_fraction: float = 0.25

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        load, dead = _finite(metrics, "moe/load_max_over_mean"), _finite(metrics, "moe/dead_frac")
        if load is None or dead is None:
            return None  # a dense model
        bad = load > self.factor or dead > self.dead_fraction
        return Verdict(
            bad,
            load,
            f"expert load max/mean {load:.3g} (limit {self.factor:g}), dead experts "
            f"{dead:.0%} (limit {self.dead_fraction:.0%}) for {self.window}+ steps",
        )


@dataclass
class RouterCollapse(Rule):
    """An MoE's router has collapsed: the top_k busiest experts of some layer take
    at least `share` of all assignments (moe/top_k_share; top_k/E when balanced)."""

    share: float = 0.9

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        top = _finite(metrics, "moe/top_k_share")
        if top is None:
            return None
        return Verdict(
            top >= self.share,
            top,
            f"router collapse: the top_k experts take {top:.0%} of the tokens "
            f"(limit {self.share:.0%})",
        )


def build_rules(alerts: Any) -> list[Rule]:
    """The rules from `tracking.alerts` (an AlertsConfig), in a fixed order."""

    def common(name: str) -> dict[str, Any]:
        c = getattr(alerts, name)
        return {
            "name": name,
            "severity": c.severity,
            "window": c.window,
            "cooldown": c.cooldown,
            "enabled": c.enabled,
        }

    return [
        NonFinite(**common("non_finite")),
        LossRising(**common("loss_rising"), smoothing=alerts.loss_rising.smoothing),
        GradSpike(**common("grad_spike"), factor=alerts.grad_spike.factor),
        ThroughputDrop(**common("throughput_drop"), fraction=alerts.throughput_drop.fraction),
        StaleCheckpoint(**common("stale_checkpoint"), minutes=alerts.stale_checkpoint.minutes),
        ExpertImbalance(
            **common("expert_imbalance"),
            factor=alerts.expert_imbalance.factor,
            dead_fraction=alerts.expert_imbalance.dead_fraction,
        ),
        RouterCollapse(**common("router_collapse"), share=alerts.router_collapse.share),
    ]


# The MoE router's rules: judged from the router metrics of a logged step (the same
# on every rank: the statistics are all-reduced), not from every step's signals.
ROUTER_RULES = ("expert_imbalance", "router_collapse")


def p0_router_rules(alerts: Any) -> list[Rule]:
    """The router rules configured as P0 (expert_imbalance, router_collapse): every
    rank judges them at each logged step of an MoE and takes the P0 action alike
    (trainlab.train.loop.metrics.P0Rules.check_router)."""
    return [
        r for r in build_rules(alerts) if r.name in ROUTER_RULES and r.severity == "P0" and r.enabled
    ]


def p0_step_rules(alerts: Any) -> list[Rule]:
    """The per-step statistical rules configured as P0 (loss_rising, grad_spike):
    the ones every rank judges to take the P0 action (trainlab.train.loop.metrics.P0Rules;
    non_finite is judged there from the ranks' flags)."""
    return [
        r
        for r in build_rules(alerts)
        if r.name in STEP_RULES and r.name != "non_finite" and r.severity == "P0" and r.enabled
    ]
