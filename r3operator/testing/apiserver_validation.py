"""Write-time validation of the API-server emulator.

Custom resources: the CRD's ``openAPIV3Schema`` via jsonschema (Kubernetes dialect converted: the
``x-kubernetes-*`` keys are dropped, ``x-kubernetes-int-or-string`` becomes integer|string,
``nullable`` adds null), structural ``default:`` values applied on write, null values of
non-nullable fields dropped (as the real server does before defaulting), unknown fields rejected
under ``fieldValidation=Strict`` and reported as a ``Warning`` header under ``Warn`` (NOT pruned:
the real server prunes them), then CEL ``x-kubernetes-validations`` via r3operator.testing.cel.

Built-in kinds: kubernetes-validate's schemas for Kubernetes 1.35 (strict when Strict).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import jsonschema
import kubernetes_validate

from r3operator.testing import cel
from r3operator.testing.apiserver_errors import ApiError, Cause
from r3operator.testing.apiserver_store import ResourceType

KUBERNETES_SCHEMA_VERSION = "1.35.0"
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ROOT_FIELDS = {"apiVersion", "kind", "metadata"}


# ------------------------------------------------------------------------- schema conversion


def to_jsonschema(node: Any) -> Any:
    """Kubernetes structural schema -> plain JSON schema (draft 7 keywords)."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "default", "description", "example"):
            continue
        if key == "properties":
            out[key] = {k: to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = to_jsonschema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_jsonschema(v) for v in value]
        elif key == "format":
            continue  # the real server checks a few formats; the emulator checks none
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    # OpenAPI v3.0 (what Kubernetes speaks) has boolean exclusiveMinimum/Maximum next to minimum/maximum;
    # draft 7 wants the bound itself as the exclusive value.
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(flag), bool) and out.pop(flag) and bound in out:
            out[flag] = out.pop(bound)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@functools.lru_cache(maxsize=64)
def _validator(schema_json: str) -> jsonschema.Draft7Validator:
    import json

    return jsonschema.Draft7Validator(to_jsonschema(json.loads(schema_json)))


# ---------------------------------------------------------------------- defaults / nulls / unknown


def apply_defaults(node: dict[str, Any] | None, value: Any) -> Any:
    """Structural defaulting: absent properties with `default:` get it; recurse into present values."""
    if not isinstance(node, dict):
        return value
    if isinstance(value, dict):
        props = node.get("properties") or {}
        for name, sub in props.items():
            if value.get(name) is None and not sub.get("nullable"):
                value.pop(name, None)  # nulls of non-nullable fields are dropped before defaulting
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key in list(value):
                if key not in props:
                    value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [apply_defaults(node["items"], item) for item in value]
    return value


def unknown_fields(node: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Paths of fields not declared in the schema (what the real server prunes or rejects)."""
    if not isinstance(node, dict) or node.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        embedded = node.get("x-kubernetes-embedded-resource") or path == ""
        for key, item in value.items():
            child = f"{path}.{key}" if path else key
            if key in props:
                if not (path == "" and key == "metadata"):
                    found += unknown_fields(props[key], item, child)
            elif isinstance(extra, dict):
                found += unknown_fields(extra, item, child)
            elif extra is True or (embedded and key in _ROOT_FIELDS):
                continue
            elif props or node.get("type") == "object":
                found.append(child)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for index, item in enumerate(value):
            found += unknown_fields(node["items"], item, f"{path}[{index}]")
    return found


# ----------------------------------------------------------------------------- error mapping


def _field(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _json_value(value: Any) -> str:
    import json

    return json.dumps(value) if isinstance(value, str | bool) or value is None else str(value)


def _cause_for(error: jsonschema.ValidationError) -> Cause:
    path = _field(error.absolute_path)
    validator = error.validator
    if validator == "required":
        missing = re.search(r"'([^']+)' is a required property", error.message)
        name = missing.group(1) if missing else "?"
        return Cause("FieldValueRequired", "Required value", f"{path}.{name}" if path else name)
    if validator == "enum":
        supported = ", ".join(_json_value(v) for v in error.validator_value)
        return Cause(
            "FieldValueNotSupported",
            f"Unsupported value: {_json_value(error.instance)}: supported values: {supported}",
            path,
        )
    if validator == "type":
        wanted = error.validator_value
        return Cause(
            "FieldValueTypeInvalid",
            f'Invalid value: "{type(error.instance).__name__}": {path} in body must be of type {wanted}: '
            f"{_json_value(error.instance)}",
            path,
        )
    if validator in ("maxLength",):
        return Cause("FieldValueTooLong", f"Too long: may not be more than {error.validator_value} bytes", path)
    if validator in ("maxItems", "maxProperties"):
        return Cause("FieldValueTooMany", f"Too many: must have at most {error.validator_value} items", path)
    return Cause("FieldValueInvalid", f"Invalid value: {_json_value(error.instance)}: {error.message}", path)


def _cel_cause(violation: cel.CelViolation) -> Cause:
    prefix = {
        "FieldValueForbidden": "Forbidden",
        "FieldValueRequired": "Required value",
        "FieldValueDuplicate": "Duplicate value",
    }.get(violation.reason)
    message = (
        f"{prefix}: {violation.message}"
        if prefix
        else (f'Invalid value: "{violation.value_type}": {violation.message}')
    )
    return Cause(violation.reason, message, violation.field_path)


# ----------------------------------------------------------------------------------- entry points


def check_metadata(rtype: ResourceType, obj: dict[str, Any]) -> None:
    name = obj.get("metadata", {}).get("name", "")
    if not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
        message = (
            f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case '
            "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        )
        raise ApiError.invalid(rtype.kind, rtype.group, name, [Cause("FieldValueInvalid", message, "metadata.name")])


def validate_custom(
    rtype: ResourceType,
    obj: dict[str, Any],
    old: dict[str, Any] | None,
    field_validation: str,
    cel_engine: str,
) -> list[str]:
    """Default + validate a custom resource in place; return warnings; raise ApiError when invalid."""
    import json

    schema = rtype.schema or {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    apply_defaults(schema, obj)
    name = obj["metadata"].get("name", "")
    warnings: list[str] = []
    unknown = unknown_fields(schema, obj)
    if unknown and field_validation == "Strict":
        listing = ", ".join(f'unknown field "{u}"' for u in unknown)
        raise ApiError.bad_request(
            f'{rtype.kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: '
            f"strict decoding error: {listing}"
        )
    if field_validation == "Warn":
        warnings = [f'unknown field "{u}"' for u in unknown]
    body = {k: v for k, v in obj.items() if k != "metadata"}
    errors = sorted(_validator(json.dumps(schema, sort_keys=True)).iter_errors(body), key=lambda e: e.path)
    causes = [_cause_for(e) for e in errors]
    if not causes:  # like the real server, CEL runs only on schema-valid objects
        try:
            if cel_engine == "cross-check":
                violations = cel.cross_check(schema, obj, old)
            else:
                violations = cel.evaluate(schema, obj, old_obj=old, engine=cel_engine)  # type: ignore[arg-type]
        except cel.CelError as exc:
            raise ApiError(500, "InternalError", f"emulator CEL evaluation failed: {exc}") from exc
        causes = [_cel_cause(v) for v in violations]
    if causes:
        raise ApiError.invalid(rtype.kind, rtype.group, name, causes)
    return warnings


def validate_builtin(rtype: ResourceType, obj: dict[str, Any], field_validation: str) -> None:
    """kubernetes-validate's schema for the built-in kind (strict under fieldValidation=Strict)."""
    document = {"apiVersion": rtype.group_version, "kind": rtype.kind, **obj}
    try:
        kubernetes_validate.validate(document, KUBERNETES_SCHEMA_VERSION, strict=field_validation == "Strict")
    except kubernetes_validate.SchemaNotFoundError:
        return
    except kubernetes_validate.ValidationError as exc:
        path = _field(exc.path)
        if exc.validator == "additionalProperties" and not exc.validator_value:
            raise ApiError.bad_request(
                f'{rtype.kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: '
                f"strict decoding error: {exc.message} at {path or '<root>'}"
            ) from exc
        name = obj.get("metadata", {}).get("name", "")
        raise ApiError.invalid(rtype.kind, rtype.group, name, [_cause_for(exc)]) from exc


def validate_crd(crd: dict[str, Any]) -> None:
    """The checks the real server does on CRD creation that the emulator relies on."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    name = crd.get("metadata", {}).get("name", "")
    causes: list[Cause] = []
    for required in ("group", "names", "scope", "versions"):
        if not spec.get(required):
            causes.append(Cause("FieldValueRequired", "Required value", f"spec.{required}"))
    for required in ("plural", "kind"):
        if not names.get(required):
            causes.append(Cause("FieldValueRequired", "Required value", f"spec.names.{required}"))
    if spec.get("group") and names.get("plural") and name != f"{names['plural']}.{spec['group']}":
        causes.append(
            Cause("FieldValueInvalid", f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group',
                  "metadata.name")
        )  # fmt: skip
    versions = spec.get("versions") or []
    if versions and sum(bool(v.get("storage")) for v in versions) != 1:
        causes.append(Cause("FieldValueInvalid", "Invalid value: must have exactly one version marked as storage "
                            "version", "spec.versions"))  # fmt: skip
    for index, version in enumerate(versions):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        for rule in cel.collect_rules(schema or {}):
            try:
                cel.check_rule(rule)
            except cel.CelError as exc:
                field = f"spec.versions[{index}].schema.openAPIV3Schema" + rule.path.rstrip(".")
                message = f"Invalid value: {rule.rule!r}: compilation failed: {exc}"
                causes.append(Cause("FieldValueInvalid", message, field))
    if causes:
        raise ApiError.invalid("CustomResourceDefinition", "apiextensions.k8s.io", name, causes)
