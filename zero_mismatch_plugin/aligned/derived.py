"""What the op layer builds from trainer parameters, kept until those parameters change.

:class:`DerivedWeight`: a weight copy in the layout and dtype vLLM's kernels take, derived again
when a source's data changes. :class:`OpCache`: ops built over parameters, built again when a
Parameter object is replaced (:func:`shared_ops`: one per runtime). Both keep a :class:`BuiltFrom`.
"""

from __future__ import annotations

import weakref

import torch


def data_key(tensors) -> tuple:
    """Each tensor's storage, in-place version and shape: changes on an in-place update (what
    optimizers do) and when ``.data`` is replaced, not on writes through ``param.data``."""
    return tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors if t is not None)


def shape_key(tensors) -> tuple:
    """Each tensor's shape only: for a derived copy whose owner refreshes it after every change of
    the sources' values (:meth:`DerivedWeight.refreshed_by_owner`)."""
    return tuple(tuple(t.shape) for t in tensors if t is not None)


def object_key(sources) -> tuple:
    """Which objects the sources are: changes when one of them is replaced by another object."""
    return tuple(map(id, sources))


class BuiltFrom:
    """``build()`` from some sources, kept while ``key(sources)`` is the key it was built at.

    ``stale`` (set by the owner) asks for ``refresh(value)`` at the next :meth:`get` that does not
    build: for writes into the sources that their key does not show."""

    def __init__(self, key):
        self.key = key
        self.value = None
        self.stale = False
        self._built_at = None
        self._sources: list = []  # held, so that the ids of an object key stay those of these objects

    def get(self, sources, build, refresh=None):
        key = self.key(sources)
        if key != self._built_at:
            self.value = build()
            self._built_at, self._sources = key, list(sources)
        elif self.stale:
            refresh(self.value)
        self.stale = False
        return self.value

    def invalidate(self) -> None:
        """Build again at the next :meth:`get`."""
        self._built_at = None


class DerivedWeight:
    """A tensor computed by ``build`` from source parameters, computed again when a source's data
    changes (:func:`data_key`); after writes through ``param.data`` call :meth:`refresh`.

    ``copies``: ``build`` returns tensors of its own, never views of a source, so what it derived
    stays valid after the sources' storage is freed or moved."""

    def __init__(self, sources, build, copies: bool = False):
        self.sources = list(sources)
        self.build = build
        self.copies = copies
        self._derived = BuiltFrom(data_key)

    def refreshed_by_owner(self) -> None:
        """Derive again only at :meth:`refresh` (or when a source's shape changes), not when a
        source's storage moves: for sources refilled in new storage with the same values at every
        use (FSDP2's gathered parameters, gathered again before every forward) whose owner calls
        :meth:`refresh` after every change of their values. A derived view of a source would keep
        storage FSDP frees, so only a ``copies`` weight can be switched."""
        if not self.copies:
            raise TypeError("this derived weight may view its sources' storage: it must follow that storage "
                            "(build it with copies=True only if build never returns a view of a source)")
        self._derived.key = shape_key
        self._derived.invalidate()

    def _derive(self):
        with torch.no_grad():
            return self.build([s.detach() if s is not None else None for s in self.sources])

    def get(self):
        return self._derived.get(self.sources, self._derive)

    def refresh(self):
        self._derived.invalidate()
        return self.get()


class OpCache:
    """Ops by key, each built over a list of sources (parameters, or the op it wraps) and built
    again when one of them is another object than it was built over (a model conversion or FSDP
    handed out a new Parameter). Data written into the same objects is each op's own
    :class:`DerivedWeight`'s business; for writes those cannot see, :meth:`mark_stale` has every
    op built so far passed to ``refresh`` at its next :meth:`get`."""

    def __init__(self, refresh=None):
        self._refresh = refresh
        self._ops: dict = {}  # key -> BuiltFrom

    def get(self, key, sources, build):
        built = self._ops.get(key)
        if built is None:
            built = self._ops[key] = BuiltFrom(object_key)
        return built.get(sources, build, self._refresh)

    def mark_stale(self) -> None:
        if self._refresh is None:
            raise TypeError("an OpCache without refresh cannot be marked stale")
        for built in self._ops.values():
            built.stale = True

    def ops(self) -> list:
        """The ops built so far."""
        return [built.value for built in self._ops.values() if built.value is not None]

    def refresh_derived(self) -> None:
        """Derive the weights of every op built so far again (each op's ``derived``): after writes
        through ``param.data``, which their keys do not see."""
        for op in self.ops():
            op.derived.refresh()


# runtime -> the ops every layer built from it shares
_PER_RUNTIME: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_ops(runtime) -> OpCache:
    """The ops shared by all layers built from ``runtime``: those holding no trainable state (the
    rotary cos/sin cache, the attention backend), as vLLM shares one rotary embedding."""
    cache = _PER_RUNTIME.get(runtime)
    if cache is None:
        cache = _PER_RUNTIME[runtime] = OpCache()
    return cache


def cast_like_engine(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the engine dtype; no copy when it already is."""
    return t if t.dtype == dtype else t.to(dtype)
