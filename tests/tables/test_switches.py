"""The plugin's environment switches: one parser (zero_mismatch_plugin.tables.switches), read by every process
and by the config checks alike."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from zero_mismatch_plugin.tables import switches
from zero_mismatch_plugin.tables.switches import SWITCHES, SwitchError

PACKAGE = Path(switches.__file__).resolve().parents[1]
SWITCH_MODULE = Path(switches.__file__).resolve()
SWITCH_NAME = re.compile(r"ZMRL_[A-Z0-9_]+")


def _sources():
    return sorted(path for path in PACKAGE.rglob("*.py") if path.resolve() != SWITCH_MODULE)


def _switch_constants() -> set[str]:
    """Names bound anywhere in the package to a ZMRL_ variable name (``ENABLE_ENV = "ZMRL_..."``)."""
    names = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str) and SWITCH_NAME.fullmatch(node.value.value):
                names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    for path in _sources():  # and the names they are imported as (``import ENABLE_ENV as FSDP_ENABLE_ENV``)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names.update(alias.asname for alias in node.names if alias.name in names and alias.asname)
    return names


def _names_a_switch(node, constants: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and bool(SWITCH_NAME.fullmatch(node.value))
    if isinstance(node, ast.Name):
        return node.id in constants
    if isinstance(node, ast.Attribute):
        return node.attr in constants
    if isinstance(node, ast.IfExp):
        return _names_a_switch(node.body, constants) or _names_a_switch(node.orelse, constants)
    return False


def _direct_reads(path: Path, constants: set[str], root: Path = PACKAGE.parent) -> list[str]:
    """Every place ``path`` reads a ZMRL_ variable from a mapping itself: ``X.get(NAME)``,
    ``getenv(NAME)``, ``X[NAME]`` (a load), ``NAME in X``, ``X.pop(NAME)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        argument = None
        if isinstance(node, ast.Call) and node.args:
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
            if called in ("get", "getenv", "pop", "setdefault"):
                argument = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            argument = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            argument = node.left
        if argument is not None and _names_a_switch(argument, constants):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_zmrl_switch_is_read_through_the_switch_module():
    constants = _switch_constants()
    assert {"ENABLE_ENV", "MODE_ENV", "ALLOW_ENV", "PREFIX_CACHING_ENV"} <= constants  # the scan sees them
    reads = [read for path in _sources() for read in _direct_reads(path, constants)]
    assert not reads, ("ZMRL_ variables read outside zero_mismatch_plugin.tables.switches (use switches.flag / "
                       "switches.choice):\n" + "\n".join(reads))


def test_the_scan_catches_a_direct_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nENABLE_ENV = "ZMRL_X"\nos.environ.get(ENABLE_ENV)\nos.getenv("ZMRL_Y", "")\n'
                      'env = {}\nenv["ZMRL_Z"]\n"ZMRL_W" in env\nenv["ZMRL_V"] = "1"\n'
                      'env.get(ENABLE_ENV if env else OTHER_ENV)\n')
    reads = _direct_reads(sample, {"ENABLE_ENV"}, root=tmp_path)
    assert [read.split(": ", 1)[1] for read in reads] == [
        "os.environ.get(ENABLE_ENV)", "os.getenv('ZMRL_Y', '')", "env['ZMRL_Z']", "'ZMRL_W' in env",
        "env.get(ENABLE_ENV if env else OTHER_ENV)"]


def test_every_switch_the_package_names_is_declared():
    named = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SWITCH_NAME.fullmatch(node.value):
                named.add(node.value)
    assert named <= set(SWITCHES), sorted(named - set(SWITCHES))


def test_the_numerics_modes_are_the_switch_values():
    from zero_mismatch_plugin.aligned.numerics import MODE_ENV, MODES

    assert tuple(value for value, _ in SWITCHES[MODE_ENV].values) == MODES


def test_docs_name_every_switch_and_its_values():
    text = (PACKAGE.parent / "docs" / "recipes.md").read_text(encoding="utf-8")
    for switch in SWITCHES.values():
        assert f"`{switch.name}`" in text, switch.name
        for value, _ in switch.values:
            assert f"`{value}`" in text, (switch.name, value)


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", None), (None, None)])
def test_a_boolean_switch_takes_1_0_or_unset(value, expected):
    env = {} if value is None else {switches.FSDP_ALIGNED: value}
    assert switches.flag(switches.FSDP_ALIGNED, env) is expected
    assert switches.enabled(switches.FSDP_ALIGNED, env) is (expected is True)


@pytest.mark.parametrize("value", ["maybe", "true", "yes", "on", " 1", "1 ", "01", "TRUE"])
def test_a_boolean_switch_refuses_every_other_spelling(value):
    with pytest.raises(SwitchError) as raised:
        switches.flag(switches.MEGATRON_ALIGNED, {switches.MEGATRON_ALIGNED: value})
    message = str(raised.value)
    assert message.startswith(f"ZMRL_MEGATRON_ALIGNED={value!r}: expected '1' (")
    assert "or '0' (off)" in message and isinstance(raised.value, ValueError)
    assert raised.value.reason.startswith(f"is {value!r}, but must be '1' (")


def test_a_choice_switch_takes_its_values_only():
    name = switches.NUMERICS
    assert switches.choice(name, {name: "consistent"}) == "consistent"
    assert switches.choice(name, {name: ""}) is None and switches.choice(name, {}) is None
    for value in ("Consistent", "garbage", "consistent "):
        with pytest.raises(SwitchError, match=rf"ZMRL_NUMERICS={value!r}: expected 'consistent' \(.*\) or 'fast'"):
            switches.choice(name, {name: value})


def test_reading_a_switch_with_the_wrong_parser_or_an_undeclared_name_is_a_programming_error():
    with pytest.raises(KeyError):
        switches.flag(switches.NUMERICS, {})
    with pytest.raises(KeyError):
        switches.choice(switches.FSDP_ALIGNED, {})
    with pytest.raises(KeyError):
        switches.flag("ZMRL_NO_SUCH", {})


def test_undeclared_names_get_the_closest_switch():
    assert switches.undeclared(["ZMRL_NUMERIC", "ZMRL_QQQQQQQQQQQQQ", "PATH", "ZMRL_NUMERICS"]) == [
        ("ZMRL_NUMERIC", "ZMRL_NUMERICS"), ("ZMRL_QQQQQQQQQQQQQ", None)]


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "", "7"])
def test_cpu_kv_cache_space(value):
    env = {switches.CPU_KV_CACHE_SPACE: value}
    if value in ("", "7"):
        assert switches.cpu_kv_cache_space(env, available_gib=8) == (None if value == "" else 7)
        return
    with pytest.raises(SwitchError, match=rf"VLLM_CPU_KVCACHE_SPACE={value!r}: expected a whole number of GiB "
                                          r"from 1 to 8 \(the memory available now\)"):
        switches.cpu_kv_cache_space(env, available_gib=8)


def test_cpu_kv_cache_space_above_the_available_memory():
    with pytest.raises(SwitchError, match="from 1 to 8 .*refuses a KV cache larger than the available memory"):
        switches.cpu_kv_cache_space({switches.CPU_KV_CACHE_SPACE: "9"}, available_gib=8)
