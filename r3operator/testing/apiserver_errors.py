"""`metav1.Status` errors of the API-server emulator, shaped like the real server's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Cause:
    """One `details.causes[]` entry; `reason` is e.g. FieldValueInvalid / FieldValueRequired."""

    reason: str
    message: str
    field: str

    def to_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.message, "field": self.field}

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass
class ApiError(Exception):
    code: int
    reason: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body

    @staticmethod
    def _details(qualified: str, name: str) -> dict[str, Any]:
        plural, _, group = qualified.partition(".")
        details: dict[str, Any] = {"name": name, "kind": plural}
        if group:
            details["group"] = group
        return details

    @classmethod
    def not_found(cls, qualified: str, name: str) -> ApiError:
        return cls(404, "NotFound", f'{qualified} "{name}" not found', cls._details(qualified, name))

    @classmethod
    def already_exists(cls, qualified: str, name: str) -> ApiError:
        return cls(409, "AlreadyExists", f'{qualified} "{name}" already exists', cls._details(qualified, name))

    @classmethod
    def conflict(cls, qualified: str, name: str) -> ApiError:
        message = (
            f'Operation cannot be fulfilled on {qualified} "{name}": the object has been modified; '
            "please apply your changes to the latest version and try again"
        )
        return cls(409, "Conflict", message, cls._details(qualified, name))

    @classmethod
    def invalid(cls, kind: str, group: str, name: str, causes: list[Cause]) -> ApiError:
        qualified_kind = f"{kind}.{group}" if group else kind
        joined = str(causes[0]) if len(causes) == 1 else "[" + ", ".join(str(c) for c in causes) + "]"
        details: dict[str, Any] = {"name": name, "kind": kind, "causes": [c.to_dict() for c in causes]}
        if group:
            details["group"] = group
        return cls(422, "Invalid", f'{qualified_kind} "{name}" is invalid: {joined}', details)

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        return cls(400, "BadRequest", message)

    @classmethod
    def unsupported_media_type(cls, content_type: str, accepted: tuple[str, ...]) -> ApiError:
        message = (
            f"the body of the request was in an unknown format - accepted media types include: "
            f"{', '.join(accepted)} (got {content_type or 'none'}; see the emulator's NOT EMULATED list)"
        )
        return cls(415, "UnsupportedMediaType", message)

    @classmethod
    def method_not_allowed(cls, message: str) -> ApiError:
        return cls(405, "MethodNotAllowed", message)

    @classmethod
    def expired(cls, message: str) -> ApiError:
        return cls(410, "Expired", message)
