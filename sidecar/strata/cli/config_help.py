"""``strata sidecar --help``: the sidecar's configuration, generated from :class:`StrataConfig`.

The sidecar (like the training client) is configured only by its environment: ``STRATA_CONFIG``
(a JSON object of :class:`strata.config.StrataConfig`, what the webhook injects in Kubernetes)
and a few override variables. This module renders both from the model itself, so the help
cannot drift from what is accepted: every field with its dotted path, type, default and the
first sentence of its docstring, and every override variable with the field it sets (found by
handing :meth:`StrataConfig.raw_from_env` each variable alone).
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import json
import re
import textwrap
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from strata import constants
from strata.config import StrataConfig

_NOT_IN_MODEL = {
    constants.ENV_RESTORE_RESHARD: "read by the training client: 0 stops restore() from "
    "resharding a step written at another world size (the default reshards when the state "
    "allows it); 1 reshards and takes per-rank values by the documented rule",
    constants.ENV_RESTORE_RESHARD_PER_RANK: "read by the training client: 1 lets a resharding "
    "restore take per-rank values (RNG, dataloader state) by the documented rule instead of "
    "refusing",
    constants.ENV_ALLOW_DISK_RAM_DIR: "1 accepts the default RAM directory on a disk outside "
    "Kubernetes (a warning instead of the refusal)",
}


@functools.cache
def _attribute_docs(cls: type) -> dict[str, str]:
    """``field -> docstring`` from the string literal right after each annotated attribute, in
    ``cls`` and the models it inherits fields from (the nearest class's docstring wins)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if isinstance(base, type) and issubclass(base, BaseModel) and base is not BaseModel:
            docs.update(_own_attribute_docs(base))
    return docs


def _own_attribute_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source (frozen app): help without the docs
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _first_sentence(text: str) -> str:
    """The first sentence, in plain text (no reST roles or literals)."""
    text = re.sub(r":\w+:`([^`]+)`", r"\1", text).replace("``", "`")
    text = re.sub(r"\s*\(issue \d+(, \w+)?\)", "", text)
    for m in re.finditer(r"\. ", text):
        if not text[: m.start()].endswith(("e.g", "i.e", "etc")):
            return text[: m.start() + 1]
    return text


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        _key, value = typing.get_args(annotation)
        return f"object of {_type_name(value)}"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return "object"
        return {"str": "string", "int": "int", "float": "number", "bool": "bool"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


def _default(info: FieldInfo, base: BaseModel | None, name: str) -> str:
    if base is not None:
        value = getattr(base, name)
    elif info.is_required():
        return "required"
    else:
        value = info.get_default(call_default_factory=True)
    return "default " + json.dumps(value, default=str)


def field_lines(
    model: type[BaseModel] = StrataConfig, prefix: str = "", base: BaseModel | None = None
) -> list[str]:
    """One line per field of ``model`` (nested models flattened with dotted paths). ``base``:
    the parent field's default instance, whose values are then the defaults shown."""
    lines: list[str] = []
    docs = _attribute_docs(model)
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = _models_in(info.annotation)
        doc = _first_sentence(docs.get(name, ""))
        if nested:
            default = getattr(base, name) if base is not None else info.get_default()
            optional = default is None and not info.is_required()
            kind = "object" if not optional else "object, default null (off)"
            if not doc:
                doc = _first_sentence(" ".join((nested[0].__doc__ or "").split()))
            lines.append(f"  {path}: {kind}{'  -- ' + doc if doc else ''}")
            for sub in nested:
                sub_base = default if isinstance(default, sub) else None
                lines.extend(field_lines(sub, f"{path}.", sub_base))
            continue
        head = f"  {path}: {_type_name(info.annotation)}, {_default(info, base, name)}"
        lines.append(f"{head}{'  -- ' + doc if doc else ''}")
    return lines


def env_lines() -> list[str]:
    """The override variables and the field each one sets."""
    lines = [
        f"  {constants.ENV_CONFIG}: JSON object of the fields below (the webhook sets it in a pod)"
    ]
    names = sorted(
        v for k, v in vars(constants).items() if k.startswith("ENV_") and v != constants.ENV_CONFIG
    )
    for var in names:
        raw = StrataConfig.raw_from_env({var: "VALUE"})
        path = _path_of(raw, "VALUE")
        if path is not None:
            lines.append(f"  {var}: sets {path} (overrides {constants.ENV_CONFIG})")
        elif var in _NOT_IN_MODEL:
            lines.append(f"  {var}: {_NOT_IN_MODEL[var]}")
    return lines


def _path_of(tree: Any, value: str, prefix: str = "") -> str | None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            if v == value:
                return f"{prefix}{k}"
            found = _path_of(v, value, f"{prefix}{k}.")
            if found is not None:
                return found
    return None


def sidecar_help() -> str:
    """The epilog of ``strata sidecar --help``."""
    example = json.dumps(
        {
            "job_id": "ns.train",
            "ram": {"path": "/dev/shm/strata"},
            "pvc": {"path": "/mnt/ckpt", "every": {"steps": 10}},
        }
    )
    return "\n".join(
        [
            "Configuration (the same for the trainer's strata.Checkpointer, which must agree):",
            "",
            "Environment:",
            *env_lines(),
            "",
            f"{constants.ENV_CONFIG} fields (unknown fields are refused, naming them):",
            *field_lines(),
            "",
            "Outside Kubernetes, start it next to the trainer with the trainer's configuration:",
            f"  {constants.ENV_CONFIG}='{example}' strata sidecar",
            "The RAM tier path must be on a tmpfs (e.g. /dev/shm): the default /strata/ram on a",
            f"disk is refused outside Kubernetes ({constants.ENV_ALLOW_DISK_RAM_DIR}=1 accepts it),",
            "any other directory on a disk gets a warning. The metrics port",
            "(metrics_port, default 9464) must be free: give each sidecar on a host its own,",
            "or 0 to disable /metrics.",
        ]
    )
