from __future__ import annotations

import pytest

from harness.domains import get_domain
from harness.domains.base import BASE_IMPORTS
from harness.sandbox.static_check import StaticCheckError, check_source, validate

OK_BODY = "\ndef run(task, model, tools):\n    return model.chat([])\n"


def violations(src: str) -> list[str]:
    return [v.message for v in check_source(src, allowed_imports=BASE_IMPORTS)]


@pytest.mark.parametrize(
    "src, expected",
    [
        ("def run(task, model, tools)\n    pass", "SyntaxError"),
        ("x = 1", "required function 'run'"),
        ("import os" + OK_BODY, "import of 'os'"),
        ("import subprocess" + OK_BODY, "import of 'subprocess'"),
        ("import ctypes" + OK_BODY, "import of 'ctypes'"),
        ("import socket" + OK_BODY, "import of 'socket'"),
        ("from os import system" + OK_BODY, "import from 'os'"),
        ("import os.path" + OK_BODY, "import of 'os.path'"),
        ("from . import x" + OK_BODY, "import from ."),
        ("from json import *" + OK_BODY, "star import"),
        ("x = ().__class__" + OK_BODY, "attribute '__class__'"),
        ("x = task._secret" + OK_BODY, "attribute '_secret'"),
        ("_hidden = 1" + OK_BODY, "name '_hidden'"),
        ("x = __builtins__" + OK_BODY, "name '__builtins__'"),
        ("x = __import__('os')" + OK_BODY, "name '__import__'"),
        ("x = eval('1')" + OK_BODY, "'eval'"),
        ("exec('x=1')" + OK_BODY, "'exec'"),
        ("c = compile('1', 'f', 'eval')" + OK_BODY, "'compile'"),
        ("f = open('/etc/passwd')" + OK_BODY, "'open'"),
        ("g = globals()" + OK_BODY, "'globals'"),
        ("g = locals()" + OK_BODY, "'locals'"),
        ("g = getattr(1, 'real')" + OK_BODY, "'getattr'"),
        ("s = '{0.__class__}'.format(1)" + OK_BODY, "format field"),
        ("s = '{0.real}'.format(1)" + OK_BODY, "format field {0.real}"),
        ("s = '{0[x]}'.format({})" + OK_BODY, "format field"),
        ("t = 'a'\ns = (t + '{0}').format(1)" + OK_BODY, ".format() only"),
        ("s = str.format('{}', 1)" + OK_BODY, ".format() only"),
        ("s = 'a'.format_map({})" + OK_BODY, "'format_map'"),
        ("def g():\n    yield 1\nf = g().gi_frame" + OK_BODY, "'gi_frame'"),
        ("x: '__import__(1)' = 1" + OK_BODY, "dunder name"),
        ("def f(_x):\n    return 1" + OK_BODY, "argument '_x'"),
        ("match 1:\n    case int(__class__=c):\n        pass" + OK_BODY, "'__class__'"),
        ("match 1:\n    case int(c):\n        pass" + OK_BODY, "positional sub-patterns"),
    ],
)
def test_rejects(src, expected):
    found = violations(src)
    assert any(expected in v for v in found), found


def test_accepts_ordinary_harness():
    src = (
        "import re\nfrom collections import Counter\nPROMPT = 'Q: {question}'\n"
        "def run(task, model, tools):\n"
        "    votes = Counter()\n"
        "    for _ in range(3):\n"
        "        content = PROMPT.format(question=task.question)\n"
        "        reply = model.chat([{'role': 'user', 'content': content}])\n"
        "        votes[reply.strip()] += 1\n"
        "    match reply:\n"
        "        case str(real=r) | {'answer': r}:\n"
        "            pass\n"
        "    return votes.most_common(1)[0][0] if votes else None\n"
    )
    assert violations(src) == []


@pytest.mark.parametrize("name", ["arith", "math", "searchqa", "chess"])
def test_seed_harnesses_pass(name):
    domain = get_domain(name)
    validate(domain.seed_harness(), allowed_imports=domain.allowed_imports)


def test_validate_raises_with_line_numbers():
    with pytest.raises(StaticCheckError, match="line 1"):
        validate("import os" + OK_BODY, allowed_imports=BASE_IMPORTS)
