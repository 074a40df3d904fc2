"""Two guards verl runs once patched: is a configured name registered, does a loss take a keyword.

The verl fork patches (verl-reject-unknown-names, verl-policy-loss-rollout-logprobs) carry their
source (``inspect.getsource``) and ``zmrl validate-config`` runs the first, so each is
self-contained: standard library only, imports inside the body, no plugin names.
"""

from __future__ import annotations


def require_registered_name(key, name, registry, kind):
    """Raise ``ValueError`` naming the config ``key`` when ``name`` is not in ``registry``.

    A plugin's names exist once its ``verl.plugins`` entry point has loaded (``import verl``
    loads them all), so an unknown name at config time is a typo or a plugin that failed.
    """
    value = getattr(name, "value", name)
    if value not in registry:
        raise ValueError(
            f"{key}={value!r} is not a registered {kind}; registered: {sorted(registry)}. "
            "Names from a plugin exist only after its verl.plugins entry point loaded without error."
        )
    return value


def accepts_keyword(fn, name):
    """Whether ``fn`` can be called with the keyword argument ``name``."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return True
        if parameter.name == name and parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            return True
    return False
