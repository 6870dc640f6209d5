"""`python -m radixrt.launch_server ...`: SGLang's `python -m sglang.launch_server ...` command line, served by
`radixrt serve` (the same flags: SGLang's names are radixrt's options or their aliases)."""

from __future__ import annotations

import sys

from radixrt.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
