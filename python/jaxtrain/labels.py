"""Label selectors (ScalingConfig.label_selector, a validation's placement): Ray's syntax with
Kubernetes' rules for label keys and values, checked here for every user of them (config,
validation, the hostfile's labels in jaxtrain.hosts, the validator)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Ray's label selector syntax (and Kubernetes' rules for label keys and values): a value is
# "v" (equal), "!v" (not equal), "in(a,b)" or "!in(a,b)".
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LABEL_SET = re.compile(r"(!?)in\((.*)\)$")


def json_key(selector: Mapping[str, str]) -> str:
    return json.dumps(dict(selector), sort_keys=True)


def requirement(value: str) -> tuple[str, tuple[str, ...]]:
    """A checked selector value as ("in" or "notin", values)."""
    found = _LABEL_SET.match(value)
    if found:
        values = tuple(v.strip() for v in found.group(2).split(","))
        return ("notin" if found.group(1) else "in", values)
    if value.startswith("!"):
        return "notin", (value[1:],)
    return "in", (value,)


def check_selector(selector: Any, num_workers: int) -> Any:
    """ScalingConfig.label_selector checked (Ray's type: a dict of label -> value for every
    worker, or a list of such dicts, one per worker), as a plain dict or list of dicts."""
    field = "ScalingConfig.label_selector"
    allowed = ("it must be a dict of label -> value such as {'accelerator': 'h100'}, a list of "
               "such dicts (one per worker), or None")
    if selector is None:
        return None
    if isinstance(selector, Mapping):
        return check_one_selector(field, selector, allowed)
    if isinstance(selector, Sequence) and not isinstance(selector, (str, bytes)):
        if len(selector) != num_workers:
            raise ValueError(f"{field}={list(selector)!r} is not allowed; a list gives one "
                             f"selector per worker: {num_workers} (num_workers), not "
                             f"{len(selector)}")
        return [check_one_selector(f"{field}[{i}]", s, allowed) for i, s in enumerate(selector)]
    raise ValueError(f"{field}={selector!r} is not allowed; {allowed}")


def check_one_selector(field: str, selector: Any, allowed: str) -> dict[str, str]:
    if not isinstance(selector, Mapping):
        raise ValueError(f"{field}={selector!r} is not allowed; {allowed}")
    for key, value in selector.items():
        if not isinstance(key, str) or not valid_key(key):
            raise ValueError(
                f"{field} label {key!r} is not allowed; a label is a name of up to 63 letters, "
                "digits, '-', '_' or '.' (beginning and ending with a letter or digit), "
                "optionally after a DNS prefix and '/', as in Kubernetes")
        values = None
        if isinstance(value, str):
            found = _LABEL_SET.match(value)
            if found:
                values = [v.strip() for v in found.group(2).split(",")]
            else:
                values = [value[1:] if value.startswith("!") else value]
        if values is None or not all(LABEL_NAME.match(v) for v in values):
            raise ValueError(
                f"{field}[{key!r}]={value!r} is not allowed; a value is a label value (up to 63 "
                "letters, digits, '-', '_' or '.'), '!value' (not equal), 'in(a,b)' or "
                "'!in(a,b)'")
    return dict(selector)


def valid_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return bool(LABEL_NAME.match(name)) and (not prefix or bool(_LABEL_PREFIX.match(prefix)))
