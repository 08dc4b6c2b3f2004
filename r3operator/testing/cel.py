"""Evaluate CRD ``x-kubernetes-validations`` (CEL) rules the way kube-apiserver does, for tests.

Two independent engines:

* ``"cel"``   - ``common-expression-language`` (Rust, with its strings/lists/math stdlib). Main engine;
  it is what the API-server emulator uses.
* ``"celpy"`` - ``cel-python`` (pure Python, core CEL only; the same stdlib functions are bridged in).
  It is type-strict like cel-go (``int == double`` is a no-overload error), so it is the cross-check
  that catches dialect drift: :func:`cross_check` runs both and raises :class:`CelDisagreement`.

Kubernetes semantics that are reproduced:

* ``self`` is bound to the value at the schema node that carries the rule; nodes absent from the
  object are skipped (so are their rules).
* A rule that references ``oldSelf`` is a *transition rule*: it runs only on update and only when the
  old object has the same node (properties by name, ``additionalProperties`` by key, list items only
  for ``x-kubernetes-list-type: map`` lists, correlated by ``x-kubernetes-list-map-keys``).
* Values are converted with the schema: ``type: number`` is a double even when the JSON says ``3``,
  ``type: integer`` stays int, ``format: date-time`` is a timestamp, ``format: duration`` a duration.
* ``messageExpression`` is evaluated to build the message; if it errors or yields a non-string or an
  empty string, ``message`` (else ``failed rule: <rule>``) is used, as in Kubernetes.
* A runtime error (e.g. a missing field without ``has()``) is a violation, like in Kubernetes.

Not reproduced: the compile-time type checker, the cost budget, ``optionalOldSelf``, optional syntax
(``self.?x``), and the Kubernetes libraries (quantity, url, ip/cidr, regex ``find``, ``isSorted``,
``format``, semver, authorizer). Rules that need them raise :class:`UnsupportedCel` with the reason.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import cel as rust_cel
import celpy
import celpy.celtypes as celtypes
from cel.stdlib import STDLIB_FUNCTIONS

Engine = Literal["cel", "celpy"]
Verdict = Literal["pass", "fail", "error"]

# Functions and macros that CEL itself provides (both engines); operators are the names that start
# with "_", "@", "!" or "-" in the reference list of a compiled program.
_CORE_FUNCTIONS = frozenset(
    {
        "size", "contains", "startsWith", "endsWith", "matches", "int", "uint", "double", "string",
        "bytes", "bool", "timestamp", "duration",
        "dyn", "type", "getFullYear", "getMonth", "getDate", "getDayOfMonth", "getDayOfWeek",
        "getDayOfYear", "getHours", "getMinutes", "getSeconds", "getMilliseconds",
    }
)  # fmt: skip
_KUBERNETES_LIBRARY_FUNCTIONS = frozenset(
    {
        "quantity", "isQuantity", "isInteger", "asInteger", "asApproximateFloat", "isGreaterThan",
        "isLessThan", "compareTo", "url", "isURL", "getScheme", "getHost", "getHostname", "getPort",
        "getEscapedPath", "getQuery", "ip", "isIP", "cidr", "isCIDR", "family", "isLoopback",
        "containsIP", "containsCIDR", "prefixLength", "masked", "find", "findAll", "isSorted", "format",
        "semver", "isSemver", "authorizer", "orValue", "hasValue", "optional", "transformList",
        "transformMap", "transformMapEntry",
    }
)  # fmt: skip
# Macros (has/all/exists/exists_one/map/filter) are expanded by the parser; if one shows up as a
# function reference it was not expanded (e.g. the two-variable form `all(k, v, ...)`): unsupported.


class CelError(Exception):
    """Base class for errors raised by this module."""


class CelCompileError(CelError):
    """A rule does not parse (kube-apiserver would reject the CRD)."""


class UnsupportedCel(CelError):
    """A rule uses CEL syntax or a Kubernetes library that the test engines do not implement."""


class CelDisagreement(CelError):
    """The two engines reached different verdicts for the same rule and object."""


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry.

    ``path`` is the schema node's JSON path: ``"."`` for the root, ``".spec"``, ``".spec.workers[*]"``
    for list items and ``".spec.labels[*]"`` for ``additionalProperties`` values.
    """

    path: str
    rule: str
    message: str | None = None
    messageExpression: str | None = None
    reason: str | None = None
    fieldPath: str | None = None
    optionalOldSelf: bool = False
    schema: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_transition(self) -> bool:
        return "oldSelf" in _references(self.rule)["variables"]


@dataclass(frozen=True)
class CelViolation:
    """A failed (or erroring) rule at a concrete location of the object.

    ``path`` is the concrete JSON path of the node (``".spec.workers[1]"``); ``field_path`` is what a
    real API server puts in ``details.causes[].field``: ``path`` without the leading dot plus the rule's
    ``fieldPath`` (``"spec.workers[1].name"``); ``""`` for the root.
    """

    path: str
    rule: str
    message: str
    reason: str
    field_path: str
    value_type: str = "object"


@dataclass(frozen=True)
class _Outcome:
    rule: CelRule
    path: str
    verdict: Verdict
    message: str
    value_type: str


# ----------------------------------------------------------------------------------------- rules


def collect_rules(openapi_schema: dict[str, Any]) -> list[CelRule]:
    """All CEL rules of a CRD ``openAPIV3Schema``, in schema order (parents before children)."""
    return [rule for path, node in _walk_schema(openapi_schema, ".") for rule in _rules_of(node, path)]


def _rules_of(node: dict[str, Any], path: str) -> list[CelRule]:
    rules = []
    for entry in node.get("x-kubernetes-validations") or []:
        if not isinstance(entry, dict) or "rule" not in entry:
            raise CelCompileError(f"x-kubernetes-validations entry at {path} has no 'rule': {entry}")
        rules.append(
            CelRule(
                path=path,
                rule=entry["rule"],
                message=entry.get("message"),
                messageExpression=entry.get("messageExpression"),
                reason=entry.get("reason"),
                fieldPath=entry.get("fieldPath"),
                optionalOldSelf=bool(entry.get("optionalOldSelf", False)),
                schema=node,
            )
        )
    return rules


def _child(path: str, suffix: str) -> str:
    return ("" if path == "." else path) + suffix


def _walk_schema(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk_schema(sub, _child(path, f".{name}"))
    if isinstance(node.get("items"), dict):
        yield from _walk_schema(node["items"], _child(path, "[*]"))
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk_schema(node["additionalProperties"], _child(path, "[*]"))


def check_rule(rule: CelRule | str) -> None:
    """Parse a rule (and its messageExpression) in both engines; raise if either cannot handle it."""
    rule_obj = rule if isinstance(rule, CelRule) else CelRule(path=".", rule=rule)
    if rule_obj.optionalOldSelf:
        raise UnsupportedCel(f"rule at {rule_obj.path} sets optionalOldSelf (needs optional types)")
    for expression in (rule_obj.rule, rule_obj.messageExpression):
        if expression:
            _compile_rust(expression)
            _compile_celpy(expression)


# ---------------------------------------------------------------------------------- compilation


@functools.lru_cache(maxsize=1024)
def _compile_rust(expression: str) -> Any:
    try:
        program = rust_cel.compile(expression)
    except ValueError as exc:
        if "unsupported syntax" in str(exc):
            raise UnsupportedCel(
                f"optional CEL syntax ('.?', '[?', '{{?') is unsupported by the test engines: {expression!r}"
            ) from exc
        raise CelCompileError(f"CEL rule does not compile: {expression!r}: {exc}") from exc
    functions = set(program.references()["functions"])
    unknown = sorted(
        name
        for name in functions
        if name[:1] not in "_@!-" and name not in _CORE_FUNCTIONS and name not in STDLIB_FUNCTIONS
    )
    if unknown:
        k8s = [name for name in unknown if name in _KUBERNETES_LIBRARY_FUNCTIONS]
        what = "Kubernetes CEL library functions" if k8s else "functions unknown to the test engines"
        raise UnsupportedCel(f"{what} {unknown} used in {expression!r}; implement them in cel.py first")
    return program


def _references(expression: str) -> dict[str, list[str]]:
    return _compile_rust(expression).references()


_CELPY_ENV = celpy.Environment()


@functools.lru_cache(maxsize=1024)
def _compile_celpy(expression: str) -> Any:
    _compile_rust(expression)  # same UnsupportedCel checks, one place
    try:
        ast = _CELPY_ENV.compile(expression)
    except celpy.CELParseError as exc:
        raise CelCompileError(f"cel-python cannot parse {expression!r}: {exc}") from exc
    return _CELPY_ENV.program(ast, functions=_celpy_bridged_functions())


@functools.lru_cache(maxsize=1)
def _celpy_bridged_functions() -> dict[str, Callable[..., Any]]:
    """The Rust engine's Python stdlib (strings/lists ext) made callable from cel-python, so that the
    cross-check compares the core language, not which library happens to ship ``lowerAscii``."""
    builtin = set(celpy.evaluation.base_functions)

    def bridge(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            return _python_to_celpy(function(*(_celpy_to_python(a) for a in args)))

        return call

    return {
        name: bridge(function) for name, function in STDLIB_FUNCTIONS.items() if "." not in name and name not in builtin
    }


# ---------------------------------------------------------------------------------- conversion


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _parse_go_duration(text: str) -> dt.timedelta | None:
    sign = -1 if text.startswith("-") else 1
    body = text.lstrip("+-")
    parts = _DURATION_PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        return None
    return dt.timedelta(seconds=sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts))


def _parse_timestamp(text: str) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def to_cel_value(value: Any, schema: dict[str, Any] | None) -> Any:
    """JSON value -> Python value with the CEL type the schema implies (number -> float, etc.)."""
    schema = schema or {}
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else None
        return {k: to_cel_value(v, props.get(k, extra)) for k, v in value.items()}
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else None
        return [to_cel_value(v, items) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and schema.get("type") == "string":
        if schema.get("format") == "date-time":
            return _parse_timestamp(value) or value
        if schema.get("format") == "duration":
            return _parse_go_duration(value) or value
    return value


def _python_to_celpy(value: Any) -> Any:
    return celpy.adapter.json_to_cel(value)


def _celpy_to_python(value: Any) -> Any:
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    if isinstance(value, celtypes.IntType | celtypes.UintType):
        return int(value)
    if isinstance(value, celtypes.DoubleType):
        return float(value)
    if isinstance(value, celtypes.StringType):
        return str(value)
    if isinstance(value, dict):
        return {_celpy_to_python(k): _celpy_to_python(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_celpy_to_python(v) for v in value]
    return value


# ---------------------------------------------------------------------------------- evaluation


def _run(expression: str, bindings: dict[str, Any], engine: Engine) -> Any:
    """Evaluate; returns the Python result or raises any exception the engine raises."""
    if engine == "cel":
        return _compile_rust(expression).execute({**bindings, **STDLIB_FUNCTIONS})
    if engine == "celpy":
        activation = {k: _python_to_celpy(v) for k, v in bindings.items()}
        result = _compile_celpy(expression).evaluate(activation)
        if isinstance(result, celpy.CELEvalError):
            raise result
        return _celpy_to_python(result)
    raise ValueError(f"unknown CEL engine {engine!r}: use 'cel' or 'celpy'")


def _instances(
    schema: dict[str, Any], value: Any, old: Any, path: str, has_old: bool
) -> Iterator[tuple[str, dict[str, Any], Any, Any, bool]]:
    """Walk object and schema together: (concrete path, schema node, value, old value, has_old)."""
    yield path, schema, value, old, has_old
    if isinstance(value, dict):
        old_map = old if has_old and isinstance(old, dict) else {}
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                yield from _instances(sub, value[name], old_map.get(name), _child(path, f".{name}"), name in old_map)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            known = set(schema.get("properties") or {})
            for key, item in value.items():
                if key not in known:
                    yield from _instances(extra, item, old_map.get(key), _child(path, f"[{key}]"), key in old_map)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        old_by_key: dict[tuple[Any, ...], Any] = {}
        keys = schema.get("x-kubernetes-list-map-keys") or []
        correlate = has_old and schema.get("x-kubernetes-list-type") == "map" and keys and isinstance(old, list)
        if correlate:
            old_by_key = {tuple(o.get(k) for k in keys): o for o in old if isinstance(o, dict)}
        for index, item in enumerate(value):
            key = tuple(item.get(k) for k in keys) if correlate and isinstance(item, dict) else None
            found = key is not None and key in old_by_key
            yield from _instances(
                items, item, old_by_key.get(key) if found else None, _child(path, f"[{index}]"), found
            )


def _message_for(rule: CelRule, bindings: dict[str, Any], engine: Engine) -> str:
    if rule.messageExpression:
        try:
            produced = _run(rule.messageExpression, bindings, engine)
        except Exception:  # Kubernetes falls back to message on any error
            produced = None
        if isinstance(produced, str) and produced.strip():
            return produced
    return rule.message or f"failed rule: {rule.rule}"


def _outcomes(schema: dict[str, Any], obj: Any, old_obj: Any, engine: Engine) -> Iterator[_Outcome]:
    for path, node, value, old, has_old in _instances(schema, obj, old_obj, ".", old_obj is not None):
        for rule in _rules_of(node, path):
            check_rule(rule)
            if rule.is_transition and not has_old:
                continue
            bindings = {"self": to_cel_value(value, node)}
            if rule.is_transition:
                bindings["oldSelf"] = to_cel_value(old, node)
            value_type = str(node.get("type", "object"))
            try:
                result = _run(rule.rule, bindings, engine)
            except Exception as exc:  # any evaluation error is a violation, as in k8s
                yield _Outcome(rule, path, "error", f"{exc} evaluating rule: {rule.rule}", value_type)
                continue
            if result is True:
                yield _Outcome(rule, path, "pass", "", value_type)
            elif result is False:
                yield _Outcome(rule, path, "fail", _message_for(rule, bindings, engine), value_type)
            else:
                message = f"rule did not evaluate to a bool (got {result!r}): {rule.rule}"
                yield _Outcome(rule, path, "error", message, value_type)


def _field_path(path: str, field_path: str | None) -> str:
    base = "" if path == "." else path.lstrip(".")
    if field_path:
        suffix = field_path if field_path.startswith("[") else "." + field_path.lstrip(".")
        return (base + suffix).lstrip(".")
    return base


def evaluate(schema: dict[str, Any], obj: Any, *, old_obj: Any = None, engine: Engine = "cel") -> list[CelViolation]:
    """Evaluate every CEL rule of ``schema`` against ``obj``; return the violations (empty = valid)."""
    return _violations(_outcomes(schema, obj, old_obj, engine))


def _violations(outcomes: Iterable[_Outcome]) -> list[CelViolation]:
    return [
        CelViolation(
            path=o.path,
            rule=o.rule.rule,
            message=o.message,
            reason=o.rule.reason or "FieldValueInvalid",
            field_path=_field_path(o.path, o.rule.fieldPath),
            value_type=o.value_type,
        )
        for o in outcomes
        if o.verdict != "pass"
    ]


def cross_check(schema: dict[str, Any], obj: Any, old_obj: Any = None) -> list[CelViolation]:
    """Evaluate with both engines; raise :class:`CelDisagreement` if any rule's verdict differs.

    Verdicts are pass / fail / error; messages are not compared. Returns the ``"cel"`` violations.
    """
    main = list(_outcomes(schema, obj, old_obj, "cel"))
    other = list(_outcomes(schema, obj, old_obj, "celpy"))
    by_location = {(o.path, o.rule.rule): o.verdict for o in other}
    for outcome in main:
        theirs = by_location.get((outcome.path, outcome.rule.rule))
        if theirs != outcome.verdict:
            raise CelDisagreement(
                f"rule {outcome.rule.rule!r} at {outcome.path}: common-expression-language says "
                f"{outcome.verdict}, cel-python says {theirs} ({outcome.message or 'no message'})"
            )
    return _violations(main)
