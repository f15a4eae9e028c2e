"""``python -m llama_megatron VERB ...`` = ``llama-megatron VERB ...``."""

import sys

from llama_megatron.cli import main

sys.exit(main())
