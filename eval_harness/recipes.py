"""Study recipes: one YAML file per study, read into a typed :class:`Recipe`.

Precedence: the dataclass defaults < the YAML file < ``--set key=value`` overrides (values are read as YAML, so
``--set lengths=[4096,8192]`` and ``--set chat=false`` work; ``--set offload.block_tokens=32`` sets one key of a
mapping). An unknown key, in the file or in an override, is an error that lists the valid keys.

Example ``recipes/ruler_qwen05.yaml``::

    study: ruler_qwen05
    suite: ruler
    model: Qwen/Qwen2.5-Coder-0.5B-Instruct
    lengths: [4096, 8192, 16384, 32768]
    methods: [dense, solohead, headwise, streaming]
    budgets: ["1/16"]
    budget_min_tokens: 512
    samples: 50
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

SUITES = ("ruler", "longbench", "longbench_e")
DTYPES = ("auto", "bfloat16", "float16", "float32")
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass
class Recipe:
    """Everything one study needs; see ``recipes/*.yaml``.

    Attributes:
        study: name of the study: results in ``{results_dir}/{study}/``, report ``{report_dir}/{study}.md``.
        suite: ``ruler``, ``longbench`` or ``longbench_e``.
        model: local folder or hub name of a transformers causal LM.
        tokenizer: tokenizer folder or hub name (default: ``model``).
        gguf_file: file name of a GGUF checkpoint inside ``model`` (transformers dequantizes it on load).
        dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``bfloat16``, ``float16`` or ``float32``.
        device: ``cuda``, ``cuda:1``, ``cpu``, ...; default: cuda if available.
        attn_implementation: the model's attention implementation for the dense baseline.
        tasks: ``all`` or a list of task names (RULER tasks or LongBench datasets).
        lengths: context lengths in tokens (RULER: prompt + answer; LongBench: the prompt's token budget for
            middle truncation). ``"4K"`` means 4096.
        methods: ``dense`` and OffloadCache selectors (``solohead``, ``headwise``, ``streaming``, ``oracle``).
        budgets: decode budgets of the offload methods: a share of the context (``"1/16"``) or tokens (``2048``).
        budget_min_tokens: floor of a budget given as a share.
        samples: samples per task and length (LongBench: a seeded subset; ``null`` = every record).
        seed: seeds the RULER samples and the LongBench subset.
        chat: use the tokenizer's chat template.
        data: LongBench data: folder of jsonl files, zip, or URL (``null``: the release's data.zip).
        batch_size: prompts per ``generate()`` call.
        prefill_chunk_size: ``generate(prefill_chunk_size=...)`` (chunked prefill); ``null`` = one-shot prefill.
        max_new_tokens: cap on the tasks' generation lengths (smoke tests only; ``null`` = the tasks' own).
        offload: extra ``OffloadCache`` keyword arguments (``block_tokens``, ``sink_tokens``, ``window_tokens``, ...).
        results_dir: root folder of raw results.
        report_dir: folder of the generated report.
        plots: draw a plot in the report (needs matplotlib).
        description: free text, kept in the results header.
    """

    study: str
    suite: str
    model: str
    tokenizer: str | None = None
    gguf_file: str | None = None
    dtype: str = "auto"
    device: str | None = None
    attn_implementation: str = "sdpa"
    tasks: list[str] | str = "all"
    lengths: list[int] = field(default_factory=lambda: [4096])
    methods: list[str] = field(default_factory=lambda: ["dense", "solohead"])
    budgets: list[str | int | float] = field(default_factory=lambda: ["1/16"])
    budget_min_tokens: int = 512
    samples: int | None = 50
    seed: int = 0
    chat: bool = True
    data: str | None = None
    batch_size: int = 1
    prefill_chunk_size: int | None = None
    max_new_tokens: int | None = None
    offload: dict = field(default_factory=dict)
    results_dir: str = "results"
    report_dir: str = "docs/results"
    plots: bool = True
    description: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check types and values; raise ``ValueError`` saying what to change."""
        hints = typing.get_type_hints(Recipe)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "lengths":
                value = self.lengths = [_parse_length(x) for x in _as_list(value, "lengths")]
            if not _matches(value, hints[f.name]):
                raise ValueError(
                    f"recipe key {f.name!r} must be {_describe(hints[f.name])}, got {value!r} ({type(value).__name__})"
                )
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.study):
            raise ValueError(f"study {self.study!r} must be a plain name (letters, digits, _ . -): it names a folder")
        if self.suite not in SUITES:
            raise ValueError(f"suite must be one of {', '.join(SUITES)}; got {self.suite!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if isinstance(self.tasks, str) and self.tasks != "all":
            self.tasks = [self.tasks]
        for name in ("lengths", "methods"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        for name in ("budget_min_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)}")
        for name in ("samples", "prefill_chunk_size", "max_new_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer or null; got {getattr(self, name)}")
        if any(x < 1 for x in self.lengths):
            raise ValueError(f"lengths must be positive; got {self.lengths}")
        from .runner import parse_budget

        for b in self.budgets:
            parse_budget(b, self.budget_min_tokens)
        if self.tasks != "all":
            self._check_tasks()

    def _check_tasks(self) -> None:
        if self.suite == "ruler":
            from .ruler import get_task

            for t in self.tasks:
                get_task(t)  # raises for unknown tasks and for qa_1 / qa_2 (not built), saying why
            return
        from .longbench import LONGBENCH_E_TASKS, LONGBENCH_TASKS

        known = LONGBENCH_E_TASKS if self.suite == "longbench_e" else LONGBENCH_TASKS
        bad = [t for t in self.tasks if t.removesuffix("_e") not in known]
        if bad:
            raise ValueError(f"{', '.join(bad)}: not {self.suite} dataset(s); choose from {', '.join(known)}")

    def to_dict(self) -> dict:
        """The recipe as plain data (for the results header)."""
        return dataclasses.asdict(self)


def valid_keys() -> list[str]:
    """Every recipe key."""
    return [f.name for f in dataclasses.fields(Recipe)]


def _as_list(value, name):
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return [value]
    raise ValueError(f"recipe key {name!r} must be a list; got {value!r}")


def _parse_length(x) -> int:
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    m = re.fullmatch(r"\s*(\d+)\s*([kK])?\s*", str(x))
    if not m:
        raise ValueError(f"a length must be a number of tokens (4096) or like '4K'; got {x!r}")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def _matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, inner) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    return {str: "a string", int: "an integer", bool: "true/false", float: "a number", dict: "a mapping"}.get(
        hint, str(hint)
    )


def _unknown(keys, where: str) -> None:
    bad = sorted(set(keys) - set(valid_keys()))
    if bad:
        names = ", ".join(map(repr, bad))
        raise ValueError(f"unknown recipe key(s) {names} in {where}; valid keys: {', '.join(valid_keys())}")


def parse_override(text: str) -> tuple[str, object]:
    """``"key=value"`` -> ``(key, value)``, the value read as YAML."""
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"an override must look like key=value (e.g. samples=10); got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ValueError(f"override {text!r}: the value is not valid YAML ({err})") from None
    return key, value


def resolve_path(recipe: str | Path) -> Path:
    """A recipe file: the path itself, or ``recipes/{name}.yaml`` for a bare name."""
    path = Path(recipe)
    if path.is_file():
        return path
    for candidate in (RECIPES_DIR / f"{recipe}.yaml", RECIPES_DIR / str(recipe)):
        if candidate.is_file():
            return candidate
    if not RECIPES_DIR.is_dir():  # installed from a wheel: the recipes are files of the source tree
        raise FileNotFoundError(
            f"no recipe file {recipe!r}; recipes by name (e.g. ruler_qwen05) are the files of recipes/ in a source "
            f"checkout, which an installed wheel does not have: pass the path of a YAML recipe"
        )
    known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))) or "none"
    raise FileNotFoundError(f"no recipe {recipe!r} (neither a file nor in {RECIPES_DIR}; shipped recipes: {known})")


def load_recipe(recipe: str | Path | dict, overrides: list[str] | None = None) -> Recipe:
    """Read a recipe (a YAML file, a recipe name from ``recipes/``, or a dict) and apply ``key=value`` overrides.

    Raises:
        ValueError: unknown keys, wrong types or values, or a missing required key (``study``, ``suite``,
            ``model``), each with what to change.
    """
    import yaml

    if isinstance(recipe, dict):
        data, where = dict(recipe), "the recipe"
    else:
        path = resolve_path(recipe)
        where = str(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a mapping of recipe keys; valid keys: {', '.join(valid_keys())}")
    _unknown(data, where)
    for text in overrides or []:
        key, value = parse_override(text)
        top, _, sub = key.partition(".")
        _unknown([top], f"override {text!r}")
        if sub:
            if top != "offload":
                raise ValueError(f"override {text!r}: only the mapping key 'offload' takes sub-keys (offload.NAME=...)")
            data[top] = {**(data.get(top) or {}), sub: value}
        else:
            data[top] = value
    missing = [k for k in ("study", "suite", "model") if data.get(k) in (None, "")]
    if missing:
        raise ValueError(f"{where} lacks the required key(s) {', '.join(missing)}")
    return Recipe(**data)
