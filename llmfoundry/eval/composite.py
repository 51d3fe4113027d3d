"""Composite scores of ICL results, as the field reports them, each with a bootstrap interval.

Results are `evaluate_tasks`' (llmfoundry/eval/icl.py): ``{key: {kind, accuracy, correct,
examples, shots, scores, label}}``. A benchmark is found by its ``(label, shots)`` (``label``
falls back to the key, a .jsonl task's file stem); where several results share one (a task split
by category), its accuracy is their plain mean and its size their sum, as llm-foundry's
EvalGauntlet averages a benchmark's sub-category accuracies and sums their sizes.

- **Eval Gauntlet** (llm-foundry's ``eval_gauntlet:`` YAML; v0.3 has 31 benchmarks in 5
  categories). A benchmark scores its accuracy ``a`` less its ``random_baseline`` ``b`` (when
  ``subtract_random_baseline``, default true), divided by ``1 - b`` (when also
  ``rescale_accuracy``, default true): below chance is negative, never clipped. A category is the
  weighted mean of its benchmarks, weighted by ``weighting``: ``EQUAL`` 1 each, ``SAMPLE_SZ``
  its examples, ``LOG_SAMPLE_SZ`` ``max(log2(examples), 1)``. Each named average (``averages:``,
  else one ``default_average`` of every category) is the plain mean of its categories. Where
  llm-foundry logs a warning and drops the category of a benchmark without results (so an
  average quietly covers less), here that is an error naming the benchmark: a composite over
  other tasks than the file names is not the number it claims to be.
- **CORE** (DCLM's, as nanochat's base_eval computes it): each benchmark centered,
  ``(a - b) / (1 - b)``, then the plain mean over benchmarks. Its baselines come from a file of
  the same shape (categories, weighting and averages play no part: CORE weighs every task
  equally by definition), so one file can serve ``--gauntlet`` and ``--core``. Baselines are
  fractions here (nanochat's CSV gives percents).
- **Intervals**: percentile bootstrap, 95%. Each replicate resamples every task's questions with
  replacement (each task by its own generator, seeded by the seed and the task's key, so adding
  a task does not move another's interval) and recomputes every accuracy and composite from the
  resampled accuracies, so a composite's interval carries the noise of all its tasks. The
  arithmetic below works alike on a float (the point) and on an array of replicates.

Hand-written rather than imported: llm-foundry's callback reads Composer's state and logger, and
the bootstrap is a few lines of numpy (scipy.stats.bootstrap resamples one statistic at a time,
not many tasks jointly).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.storage import read_small
from llmfoundry.utils.yaml_guard import safe_load

__all__ = [
    "WEIGHTINGS",
    "Benchmark",
    "Composites",
    "Gauntlet",
    "bootstrap_accuracies",
    "check_benchmarks",
    "composite_report",
    "core_scores",
    "gauntlet_scores",
    "parse_gauntlet",
    "read_gauntlet",
    "report_json",
    "report_table",
]

WEIGHTINGS = ("EQUAL", "SAMPLE_SZ", "LOG_SAMPLE_SZ")
MAX_GAUNTLET_BYTES = 1 << 20  # v0.3 is 3 KB
LEVEL = 0.95
# Elements of one chunk of resampled indices: bounds memory for tasks of any size.
_CHUNK_ELEMENTS = 1 << 22

Value = TypeVar("Value", float, np.ndarray)
Key = tuple[str, int]  # (label, shots)


@dataclass(frozen=True)
class Benchmark:
    name: str
    shots: int
    random_baseline: float

    @property
    def key(self) -> str:
        """llm-foundry's name of a benchmark's results: ``label/N-shot``."""
        return f"{self.name}/{self.shots}-shot"


@dataclass(frozen=True)
class Gauntlet:
    categories: dict[str, tuple[Benchmark, ...]]
    averages: dict[str, tuple[str, ...]]
    weighting: str = "EQUAL"
    subtract_random_baseline: bool = True
    rescale_accuracy: bool = True
    benchmarks: tuple[Benchmark, ...] = field(init=False)

    def __post_init__(self) -> None:
        """`benchmarks`: each once, in order (one may serve two categories, with one baseline)."""
        unique: dict[str, Benchmark] = {}
        for b in (b for bs in self.categories.values() for b in bs):
            if unique.setdefault(b.key, b) != b:
                raise UserError(
                    f"benchmark {b.key} is listed with random_baseline {unique[b.key].random_baseline}"
                    f" and {b.random_baseline}; give it one"
                )
        object.__setattr__(self, "benchmarks", tuple(unique.values()))


def read_gauntlet(url: str) -> Gauntlet:
    """The gauntlet in the YAML file `url` (local or fsspec): an ``eval_gauntlet:`` key, as in
    llm-foundry's files, or the mapping itself."""
    try:
        text = read_small(url, MAX_GAUNTLET_BYTES).decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise MissingInput(f"{url} does not exist; check the gauntlet file's path") from None
    return parse_gauntlet(safe_load(text, where=url), url)


def _is_list(value: Any) -> bool:
    """A YAML list, also as a config's ListConfig (the callback's inline gauntlet)."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _keys(where: str, spec: Any, required: set[str], optional: set[str]) -> dict[str, Any]:
    if not isinstance(spec, Mapping):
        raise UserError(f"{where}: expected a mapping, got {type(spec).__name__}")
    missing, unknown = required - set(spec), set(spec) - required - optional
    if missing or unknown:
        raise UserError(
            f"{where}: "
            + "; ".join(
                [f"missing {sorted(missing)}"] * bool(missing)
                + [f"unknown {sorted(unknown)}"] * bool(unknown)
            )
            + f" (keys: {sorted(required)}, optionally {sorted(optional)})"
        )
    return dict(spec)


def _benchmark(spec: Any, where: str, needs_baseline: bool) -> Benchmark:
    required = {"name", "num_fewshot"} | ({"random_baseline"} if needs_baseline else set())
    spec = _keys(where, spec, required, {"random_baseline"})
    shots, baseline = spec["num_fewshot"], spec.get("random_baseline", 0.0)
    if not isinstance(spec["name"], str) or isinstance(shots, bool) or not isinstance(shots, int):
        raise UserError(f"{where}: name must be a string and num_fewshot a whole number")
    if isinstance(baseline, bool) or not isinstance(baseline, int | float):
        raise UserError(f"{where}: random_baseline must be a number, got {baseline!r}")
    if not 0 <= baseline < 1:
        raise UserError(
            f"{where}: random_baseline {baseline} is outside [0, 1): it is chance accuracy as "
            "a fraction (0.25 for four choices)"
        )
    return Benchmark(spec["name"], shots, float(baseline))


def parse_gauntlet(spec: Any, where: str = "eval_gauntlet") -> Gauntlet:
    """A gauntlet from its YAML mapping (module docstring); a one-line `UserError` for a key
    missing, unknown or of the wrong type."""
    if isinstance(spec, Mapping) and "eval_gauntlet" in spec:
        spec = _keys(where, spec, {"eval_gauntlet"}, set())["eval_gauntlet"]
        where = f"{where}: eval_gauntlet"
    optional = {"weighting", "subtract_random_baseline", "rescale_accuracy", "averages"}
    spec = _keys(where, spec, {"categories"}, optional)
    weighting = spec.get("weighting", "EQUAL")
    if weighting not in WEIGHTINGS:
        raise UserError(f"{where}: weighting {weighting!r} is not one of {list(WEIGHTINGS)}")
    subtract = spec.get("subtract_random_baseline", True)
    rescale = spec.get("rescale_accuracy", True)
    if not (isinstance(subtract, bool) and isinstance(rescale, bool)):
        raise UserError(f"{where}: subtract_random_baseline and rescale_accuracy are true/false")
    if rescale and not subtract:
        raise UserError(
            f"{where}: rescale_accuracy needs subtract_random_baseline (it divides the gain "
            "over chance by 1 - baseline); set both, or rescale_accuracy: false"
        )
    if not _is_list(spec["categories"]) or not spec["categories"]:
        raise UserError(f"{where}: categories must list at least one category")
    categories: dict[str, tuple[Benchmark, ...]] = {}
    for i, category in enumerate(spec["categories"]):
        here = f"{where}: categories[{i}]"
        category = _keys(here, category, {"name", "benchmarks"}, set())
        name, benchmarks = category["name"], category["benchmarks"]
        if not isinstance(name, str) or name in categories:
            raise UserError(f"{here}: name {name!r} must be a string naming no other category")
        if not _is_list(benchmarks) or not benchmarks:
            raise UserError(f"{here}: benchmarks must list at least one benchmark")
        categories[name] = tuple(
            _benchmark(b, f"{here}.benchmarks[{j}]", subtract) for j, b in enumerate(benchmarks)
        )
    return Gauntlet(
        categories, _averages(spec.get("averages"), categories, where), weighting, subtract, rescale
    )


def _gauntlet_from(spec: str | Mapping[str, Any] | None) -> Gauntlet | None:
    if spec is None:
        return None
    return read_gauntlet(spec) if isinstance(spec, str) else parse_gauntlet(spec)


def _averages(spec: Any, categories: Mapping[str, Any], where: str) -> dict[str, tuple[str, ...]]:
    if spec is None:
        return {"default_average": tuple(categories)}  # llm-foundry's name for it
    if not isinstance(spec, Mapping):
        raise UserError(f"{where}: averages must map names to lists of categories")
    averages = {}
    for name, members in spec.items():
        if name in categories:
            raise UserError(f"{where}: average {name!r} is also a category's name; rename one")
        if not _is_list(members) or not members:
            raise UserError(f"{where}: average {name!r} must list at least one category")
        unknown = [m for m in members if m not in categories]
        if unknown:
            raise UserError(
                f"{where}: average {name!r} names {unknown}, not categories of the gauntlet "
                f"({list(categories)})"
            )
        averages[str(name)] = tuple(members)
    return averages


def _groups(results: Mapping[str, Mapping[str, Any]]) -> dict[Key, list[str]]:
    """The result keys of each (label, shots)."""
    groups: dict[Key, list[str]] = {}
    for key, r in results.items():
        groups.setdefault((r.get("label", key), r["shots"]), []).append(key)
    return groups


def check_benchmarks(benchmarks: Sequence[Benchmark], available: set[Key], what: str) -> None:
    """Raise a one-line `UserError` naming the benchmarks of `what` that no result answers."""
    missing = [b.key for b in benchmarks if (b.name, b.shots) not in available]
    if missing:
        scored = ", ".join(f"{label}/{shots}-shot" for label, shots in sorted(available))
        raise UserError(
            f"{what} names {', '.join(missing)}, not among the tasks scored ({scored}); score a "
            "task of that label at that many shots, or remove it from the file"
        )


def _weight(weighting: str, size: int) -> float:
    size = max(size, 1)
    if weighting == "SAMPLE_SZ":
        return float(size)
    if weighting == "LOG_SAMPLE_SZ":
        return max(math.log2(size), 1.0)
    return 1.0


def gauntlet_scores(
    gauntlet: Gauntlet, accuracy: Mapping[Key, Value], sizes: Mapping[Key, int]
) -> dict[str, dict[str, Value]]:
    """``{"benchmarks": {label/N-shot: score}, "categories": {..}, "averages": {..}}`` from each
    benchmark's accuracy (a float, or an array of bootstrap replicates) and examples."""
    scores: dict[str, Value] = {}
    categories: dict[str, Value] = {}
    for name, benchmarks in gauntlet.categories.items():
        weights = [_weight(gauntlet.weighting, sizes[(b.name, b.shots)]) for b in benchmarks]
        total = sum(weights)
        category = 0.0
        for b, weight in zip(benchmarks, weights, strict=True):
            score = accuracy[(b.name, b.shots)]
            if gauntlet.subtract_random_baseline:
                score = score - b.random_baseline
            if gauntlet.rescale_accuracy:
                score = score / (1.0 - b.random_baseline)
            scores[b.key] = score
            category = category + score * (weight / total)
        categories[name] = category
    averages = {
        name: sum(categories[c] for c in members) / len(members)
        for name, members in gauntlet.averages.items()
    }
    return {"benchmarks": scores, "categories": categories, "averages": averages}


def core_scores(
    benchmarks: Sequence[Benchmark], accuracy: Mapping[Key, Value]
) -> tuple[dict[str, Value], Value]:
    """Each benchmark's centered accuracy ``(a - b) / (1 - b)`` and their plain mean, CORE."""
    centered = {
        b.key: (accuracy[(b.name, b.shots)] - b.random_baseline) / (1.0 - b.random_baseline)
        for b in benchmarks
    }
    return centered, sum(centered.values()) / len(centered)


def _scores(key: str, result: Mapping[str, Any]) -> np.ndarray:
    scores = result.get("scores")
    if not scores:
        raise UserError(
            f"task {key} has no per-example scores to resample; score it with evaluate_tasks "
            "(llmfoundry/eval/icl.py), or set the bootstrap to 0 resamples"
        )
    return np.asarray(scores, dtype=np.float64)


def bootstrap_accuracies(
    results: Mapping[str, Mapping[str, Any]], resamples: int, seed: int
) -> dict[str, np.ndarray]:
    """`resamples` bootstrap replicates of each task's accuracy: its `scores` drawn with
    replacement, as many as it has, by a generator seeded with (`seed`, the task's key)."""
    replicates = {}
    for key, result in results.items():
        scores = _scores(key, result)
        n = len(scores)
        rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
        chunk = max(1, _CHUNK_ELEMENTS // n)
        replicates[key] = np.concatenate(
            [
                scores[rng.integers(0, n, size=(min(chunk, resamples - start), n))].mean(axis=1)
                for start in range(0, resamples, chunk)
            ]
            or [np.empty(0)]
        )
    return replicates


def _benchmark_accuracy(
    groups: Mapping[Key, list[str]], accuracy: Mapping[str, Value]
) -> dict[Key, Value]:
    return {k: sum(accuracy[key] for key in keys) / len(keys) for k, keys in groups.items()}


def _interval(replicates: np.ndarray | None) -> list[float] | None:
    if replicates is None:
        return None
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(replicates, [tail, 100 - tail])
    return [float(low), float(high)]


def _entry(point: float, replicates: np.ndarray | None) -> dict[str, Any]:
    return {"score": float(point), "ci95": _interval(replicates)}


def _check_bootstrap(resamples: Any, seed: Any) -> None:
    for name, value in (("resamples", resamples), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"the bootstrap {name} must be a whole number >= 0, got {value!r}")


def composite_report(
    results: Mapping[str, Mapping[str, Any]],
    gauntlet: Gauntlet | None = None,
    core: Sequence[Benchmark] | None = None,
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Intervals of every accuracy and the gauntlet's and CORE's scores, as JSON-ready data:
    ``{"tasks": {key: {accuracy, ci95}}, "mean": .., "gauntlet": {benchmarks, categories,
    averages}, "core": {score, ci95, centered}, "bootstrap": {resamples, seed, level}}``
    (``ci95`` is ``[low, high]``, or None at 0 resamples; gauntlet and core only when given)."""
    _check_bootstrap(resamples, seed)
    groups = _groups(results)
    if gauntlet is not None:
        check_benchmarks(gauntlet.benchmarks, set(groups), "the gauntlet")
    if core is not None:
        check_benchmarks(core, set(groups), "the CORE file")
    points = {key: float(r["accuracy"]) for key, r in results.items()}
    reps = bootstrap_accuracies(results, resamples, seed) if resamples else None
    report: dict[str, Any] = {
        "tasks": {
            key: {"accuracy": points[key], "ci95": _interval(reps and reps[key])} for key in results
        },
        "bootstrap": {"resamples": resamples, "seed": seed, "level": LEVEL},
    }
    if results:
        mean = lambda acc: sum(acc.values()) / len(acc)  # noqa: E731
        report["mean"] = _entry(mean(points), reps and mean(reps))
    sizes = {k: sum(results[key]["examples"] for key in keys) for k, keys in groups.items()}
    acc_point = _benchmark_accuracy(groups, points)
    acc_reps = _benchmark_accuracy(groups, reps) if reps else None
    if gauntlet is not None:
        point = gauntlet_scores(gauntlet, acc_point, sizes)
        rep = gauntlet_scores(gauntlet, acc_reps, sizes) if acc_reps else None
        report["gauntlet"] = {
            "weighting": gauntlet.weighting,
            "subtract_random_baseline": gauntlet.subtract_random_baseline,
            "rescale_accuracy": gauntlet.rescale_accuracy,
        } | {
            part: {name: _entry(v, rep and rep[part][name]) for name, v in point[part].items()}
            for part in ("benchmarks", "categories", "averages")
        }
    if core is not None:
        centered, score = core_scores(core, acc_point)
        rep_centered, rep_score = core_scores(core, acc_reps) if acc_reps else ({}, None)
        report["core"] = _entry(score, rep_score) | {
            "centered": {k: _entry(v, rep_centered.get(k)) for k, v in centered.items()}
        }
    return report


@dataclass(frozen=True)
class Composites:
    """What to compute beside the accuracies, read before any task is scored so a bad file
    fails at once: eval.py's ``--gauntlet``, ``--core``, ``--bootstrap``, ``--bootstrap-seed``
    and the ``icl_eval`` callback's ``gauntlet``, ``core``."""

    gauntlet: Gauntlet | None = None
    core: tuple[Benchmark, ...] | None = None
    resamples: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        _check_bootstrap(self.resamples, self.seed)

    @classmethod
    def read(
        cls,
        gauntlet: str | Mapping[str, Any] | None,
        core: str | Mapping[str, Any] | None,
        resamples: int = 1000,
        seed: int = 0,
    ) -> Composites:
        """From files (paths or URLs) or mappings (a config's inline ``eval_gauntlet:``)."""
        core_file = _gauntlet_from(core)
        core_benchmarks = None if core_file is None else core_file.benchmarks
        return cls(_gauntlet_from(gauntlet), core_benchmarks, resamples, seed)

    def check(self, available: set[Key]) -> None:
        """Refuse benchmarks that no task of ``(label, shots)`` in `available` will answer."""
        if self.gauntlet is not None:
            check_benchmarks(self.gauntlet.benchmarks, available, "the gauntlet")
        if self.core is not None:
            check_benchmarks(self.core, available, "the CORE file")

    def report(self, results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        return composite_report(results, self.gauntlet, self.core, self.resamples, self.seed)

    def metrics(self, results: Mapping[str, Mapping[str, Any]], prefix: str) -> dict[str, float]:
        """The composites' points as metrics: ``<prefix>gauntlet/<category or average>``,
        ``<prefix>core`` (no intervals: what a training curve plots)."""
        report = composite_report(results, self.gauntlet, self.core, 0)
        gauntlet = report.get("gauntlet", {})
        metrics = {
            f"{prefix}gauntlet/{name}": entry["score"]
            for part in ("categories", "averages")
            for name, entry in gauntlet.get(part, {}).items()
        }
        if "core" in report:
            metrics[f"{prefix}core"] = report["core"]["score"]
        return metrics


def report_json(results: Mapping[str, Mapping[str, Any]], report: Mapping[str, Any]) -> dict:
    """The results, each task with its ``ci95``, and the report's composites: what --out holds."""
    tasks = {key: {**r, "ci95": report["tasks"][key]["ci95"]} for key, r in results.items()}
    return {"tasks": tasks} | {k: v for k, v in report.items() if k != "tasks"}


def _cells(entry: Mapping[str, Any], value: str = "score") -> str:
    interval = entry["ci95"]
    text = f"{entry[value]:>8.4f}"
    return text + (f"  [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else "")


def report_table(results: Mapping[str, Mapping[str, Any]], report: Mapping[str, Any]) -> str:
    """The results and `composite_report`'s `report` as a fixed-width text table: each task's
    accuracy, their mean, then the gauntlet's categories and averages and CORE, each with its
    95% interval when there is one."""
    names = [*results, *report.get("gauntlet", {}).get("categories", {})]
    names += [*report.get("gauntlet", {}).get("averages", {}), "CORE"]
    width = max(map(len, ["task", *names]))
    interval = "  95% interval" if report["bootstrap"]["resamples"] else ""
    lines = [f"{'task':<{width}}  {'kind':<17}  shots  examples  accuracy{interval}"]
    for key, r in results.items():
        lines.append(
            f"{key:<{width}}  {r['kind']:<17}  {r['shots']:>5}  {r['examples']:>8}  "
            + _cells(report["tasks"][key], "accuracy")
        )
    if "mean" in report:
        lines.append(f"{'mean':<{width}}  {'':<17}  {'':>5}  {'':>8}  " + _cells(report["mean"]))
    row = lambda name, what, entry: f"{name:<{width}}  {what:<34}  " + _cells(entry)  # noqa: E731
    if "gauntlet" in report:
        g = report["gauntlet"]
        how = ", baseline subtracted" * g["subtract_random_baseline"]
        how += ", rescaled" * g["rescale_accuracy"]
        lines += ["", f"gauntlet: {g['weighting']} weighting{how}"]
        lines += [row(name, "category", e) for name, e in g["categories"].items()]
        lines += [row(name, "average", e) for name, e in g["averages"].items()]
    if "core" in report:
        count = f"centered mean of {len(report['core']['centered'])} tasks"
        lines += ["", row("CORE", count, report["core"])]
    return "\n".join(lines)
