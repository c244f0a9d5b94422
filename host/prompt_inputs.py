"""A queued prompt's raw inputs, seen through ComfyUI's on-prompt handlers (``PromptServer.add_on_prompt_handler``,
the public seam custom nodes use to look at a prompt before ComfyUI validates it), and the one place the pack adds
such handlers.

Why the pack looks at raw inputs: while ComfyUI validates a prompt it turns a BOOLEAN input into ``bool(value)`` in
place, so the string ``"false"`` sent to ``/prompt`` (a hand-written API prompt, a script) reaches the node as
``True``; neither the node's ``execute`` nor its ``validate_inputs`` can tell any more. For an option that writes
files (Wan Loader's ``save_quantized``, the text encoders' ``cache_embeddings``) that writes what the user turned
off. A node class lists such options in ``STRICT_BOOLEANS``; ``check_strict_booleans`` replaces a value of one that
is not a JSON boolean (nor a link) with a NotABoolean, a string whose truth value raises. ComfyUI's own validation
then refuses the prompt with an ``invalid_input_type`` error naming the node, the option and the fix, before
anything runs. A handler never raises: a prompt it cannot read goes on as it came.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("comfyui_lowvram_dit")


class NotABoolean(str):
    """A non-boolean value given for a file-writing option: ComfyUI's ``bool(value)`` raises TypeError(message)."""

    def __new__(cls, text: str, message: str = "") -> NotABoolean:
        value = super().__new__(cls, text)
        value.message = message or f"{text!r} is not a boolean"
        return value

    def __bool__(self) -> bool:
        raise TypeError(self.message)


def _raw(value: Any) -> Any:
    """An input's value as sent, unwrapped from ComfyUI's ``{"__value__": ...}``."""
    return value["__value__"] if isinstance(value, dict) and "__value__" in value else value


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return f"the string {value[:60]!r}"
    return "null" if value is None else f"the {type(value).__name__} {str(value)[:60]}"


def strict_options(class_type: Any) -> tuple[str, ...]:
    """The options of the pack's node ``class_type`` that take only a real boolean (none for other nodes)."""
    import nodes

    cls = nodes.NODE_CLASS_MAPPINGS.get(class_type) if isinstance(class_type, str) else None
    options = getattr(cls, "STRICT_BOOLEANS", ()) if cls is not None else ()
    return tuple(o for o in options if isinstance(o, str))


def check_strict_booleans(json_data: Any) -> Any:
    """On-prompt handler: every STRICT_BOOLEANS option given anything but true / false (or a link) becomes a
    NotABoolean that ComfyUI's validation refuses, naming the node and the option. Returns the prompt."""
    try:
        prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
        for node_key, node in (prompt.items() if isinstance(prompt, dict) else ()):
            inputs = node.get("inputs") if isinstance(node, dict) else None
            if not isinstance(inputs, dict):
                continue
            for option in strict_options(node.get("class_type")):
                raw = _raw(inputs.get(option)) if option in inputs else True
                if isinstance(raw, (bool, list)):  # a boolean, or a link to another node's output
                    continue
                inputs[option] = NotABoolean(str(raw)[:200], (
                    f"node {node_key} ({node.get('class_type')}), {option}: got {_kind(raw)}, not a boolean; send "
                    f"true or false (a JSON boolean): ComfyUI would read it as {bool(raw)}, and this option "
                    "writes files"))
    except Exception as exc:  # noqa: BLE001 - a prompt must never fail because of this check itself
        log.debug("lowvram_dit: strict boolean check skipped for a prompt (%s)", exc)
    return json_data


def add_prompt_handler(handler: Callable[[Any], Any], prompt_server: Any = None) -> bool:
    """Add ``handler`` to the server's on-prompt handlers once (chained after any there); False without a server."""
    if prompt_server is None:
        try:
            from server import PromptServer

            prompt_server = PromptServer.instance
        except (ImportError, AttributeError):  # no server (a script, the tests): nothing to hook into
            return False
    handlers = getattr(prompt_server, "on_prompt_handlers", None)
    if not isinstance(handlers, list):
        return False
    if not any(getattr(h, "__qualname__", "") == handler.__qualname__
               and getattr(h, "__module__", "") == handler.__module__ for h in handlers):
        prompt_server.add_on_prompt_handler(handler)
    return True
