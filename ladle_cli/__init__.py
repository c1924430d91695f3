"""The `ladle` command (`ladle serve | engine | gateway | batch | bench`): the top layer, which wires the engine
and the gateway together. Nothing below it imports it (tests/unit/test_layers.py).

`main.py` parses the flags and hands off; `serve.py` runs an engine child and the gateway on one host;
`batch_file.py` runs an OpenAI batch file offline; `engine_child.py` starts the engine child of both.
"""

from ladle_cli.main import ASYNC_SCHEDULING, build_parser, main

__all__ = ["ASYNC_SCHEDULING", "build_parser", "main"]
