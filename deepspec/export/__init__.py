"""Export: vLLM / SGLang checkpoint writers (writers.py) and the `deepspec export` CLI (cli.py)."""
