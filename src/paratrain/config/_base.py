"""Shared base for the contract models and the error type every loader raises.

The contract follows serde's behaviour for the Rust crates: unknown keys are ignored,
an unknown tag value is an error, every documented field is required. Fields we add
(extensions) carry defaults and are left out of ``dump`` unless the user set them, so
``dump(load(x)) == x`` holds for documents written against the Rust shapes.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# usize in Rust: a non-negative JSON integer; floats, bools and strings are rejected.
Count = Annotated[int, Field(ge=0, strict=True)]
# A count where zero makes no sense (num_replicas, rounds, ...).
PositiveCount = Annotated[int, Field(ge=1, strict=True)]
# A fraction in (0, 1].
Fraction = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class ConfigError(ValueError):
    """Bad user input in a job or contract document: ``problems`` holds one ``(field_path,
    message)`` pair per problem; ``str(err)`` prints one line each, field path first."""

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems: list[tuple[str, str]] = list(problems)
        super().__init__("\n".join(f"{p}: {m}" if p else m for p, m in self.problems))


def one_line(msg: str, limit: int = 300) -> str:
    """The first line of ``msg``, cut to ``limit`` characters: a ConfigError message quoting
    an error the job's own code (or a library) raised."""
    line = (msg.splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _loc_to_path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    parts: list[str] = [prefix] if prefix else []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            continue
        # Pydantic puts the union member's tag (or a function name) into the path;
        # the user never wrote those, so they are dropped from the printed path.
        if item in _UNION_NOISE or item.startswith("function-"):
            continue
        parts.append(("." if parts else "") + item)
    return "".join(parts).replace(".[", "[") or "<root>"


_UNION_NOISE: set[str] = set()
_NAMED = re.compile(r"([a-z_]+(?:\.[a-z_]+)*): (.+)", re.DOTALL)


def register_tags(tags: Iterable[str]) -> None:
    """Record tag names so they are not shown as path segments in error messages."""
    _UNION_NOISE.update(tags)


def format_validation_error(err: ValidationError, prefix: str = "") -> ConfigError:
    """Turn a pydantic error into a ConfigError naming each field path and value."""
    problems: list[tuple[str, str]] = []
    for e in err.errors(include_url=False):
        path = _loc_to_path(tuple(e["loc"]), prefix)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            tag = str((e.get("ctx") or {}).get("discriminator", "")).strip("'")
            path = f"{path}.{tag}" if path != "<root>" else tag
            if e["type"] == "union_tag_not_found":
                msg = f"missing tag field {tag!r}"
        elif e["type"] == "missing":
            msg = "missing required field"
        elif path == "<root>" and (named := _NAMED.match(msg)):
            path, msg = named.group(1), named.group(2)  # a whole-job check naming its field
        elif "input" in e and e["type"] != "value_error":
            value = e["input"]
            if not isinstance(value, dict | list) or len(repr(value)) < 80:
                msg = f"{msg} (got {value!r})"
        problems.append((path, msg))
    return ConfigError(problems)


# id(instance) -> the keys its input carried that the contract ignores (serde leniency).
# Kept outside the instance so equality and hashing (field values only) are unchanged;
# an entry is dropped when its instance is garbage collected.
_UNKNOWN: dict[int, tuple[str, ...]] = {}


def is_set(model: BaseModel, name: str) -> bool:
    """``name`` was given explicitly and differs from its default (what the
    ignored-settings report counts as set: :mod:`paratrain.config.effective`)."""
    if name not in model.model_fields_set:
        return False
    info = type(model).model_fields[name]
    return bool(getattr(model, name) != info.get_default(call_default_factory=True))


def unknown_keys(obj: object) -> tuple[str, ...]:
    """The keys of the document ``obj`` was validated from that its contract ignored
    (empty for an instance built in Python or copied)."""
    return _UNKNOWN.get(id(obj), ())


def describe_tags(schema: dict[str, Any], cls: type) -> None:
    """JSON Schema hook: a discriminator tag (a property with a single ``const`` value,
    e.g. ``method = "TopK"``) is described as the variant it selects. Every other field
    is described by its attribute docstring (``use_attribute_docstrings``)."""
    for name, prop in (schema.get("properties") or {}).items():
        if isinstance(prop, dict) and "const" in prop and not prop.get("description"):
            prop["description"] = f"{name} = {prop['const']!r} selects {cls.__name__}."


_FROZEN_DOCUMENTED = ConfigDict(frozen=True, use_attribute_docstrings=True,
                                json_schema_extra=describe_tags)


class Contract(BaseModel):
    """Frozen, serde-like model; extension fields are dumped only when set. Unknown keys are
    ignored (as serde does) but remembered (:func:`unknown_keys`), for ``paratrain validate``."""

    model_config = ConfigDict(extra="ignore", **_FROZEN_DOCUMENTED)
    _extensions: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        # pydantic names a union member in an error path by its tag (discriminated unions)
        # or its class name (RemoteTarget): neither is a segment the user wrote.
        tags = [f.default for n, f in cls.model_fields.items() if n in ("method", "type", "protocol")]
        register_tags([cls.__name__, *(t for t in tags if isinstance(t, str))])

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown_keys(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        obj = handler(data)
        if isinstance(data, dict) and isinstance(obj, Contract):
            unknown = tuple(str(k) for k in data if k not in cls.model_fields)
            if unknown:
                key = id(obj)
                _UNKNOWN[key] = unknown
                weakref.finalize(obj, _UNKNOWN.pop, key, None)
        return obj

    @model_serializer(mode="wrap")
    def _drop_unset_extensions(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in self._extensions:
                if name not in self.model_fields_set:
                    data.pop(name, None)
        return data


class Section(BaseModel):
    """A job-file section: unknown keys are refused (a misspelled option should not be
    silently ignored)."""

    model_config = ConfigDict(extra="forbid", **_FROZEN_DOCUMENTED)


class OpenSection(BaseModel):
    """A section whose unknown keys are kwargs for a user's factory."""

    model_config = ConfigDict(extra="allow", **_FROZEN_DOCUMENTED)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class Codec:
    """Load, dump and schema of a contract or tagged union of them (a pydantic ``TypeAdapter``):
    ``load`` takes JSON text, a dict or an already built contract."""

    def __init__(self, union: Any) -> None:
        self._adapter: TypeAdapter[Any] = TypeAdapter(union)

    def load(self, doc: str | bytes | dict[str, Any] | Contract) -> Any:
        """Validate from JSON text or a dict; every failure is a ConfigError."""
        if isinstance(doc, Contract):
            return doc
        if isinstance(doc, str | bytes):
            try:
                doc = json.loads(doc)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError([("<root>", f"not valid JSON: {e}")]) from None
        try:
            return self._adapter.validate_python(doc)
        except ValidationError as e:
            raise format_validation_error(e) from None

    def dump(self, value: Any) -> dict[str, Any]:
        """The JSON-compatible dict (extensions only when set)."""
        out: dict[str, Any] = self._adapter.dump_python(value, mode="json")
        return out

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = self._adapter.json_schema()
        return out


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_every(value: int | str) -> tuple[int, float | None]:
    """``run.checkpoint_every`` as ``(steps, seconds)``: an int is a step count (0: once
    per epoch); a string ``"<number><s|m|h>"`` ("90s", "10m", "1.5h") is a wall-time
    cadence. Raises ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"must be a step count or a duration like '10m', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must be >= 0 steps, got {value}")
        return value, None
    m = _DURATION.match(str(value))
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"must be a step count or a positive duration like '90s', '10m' or "
                         f"'1h', got {value!r}")
    return 0, float(m.group(1)) * _UNIT_S[m.group(2)]
