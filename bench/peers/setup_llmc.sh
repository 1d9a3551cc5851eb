#!/usr/bin/env bash
# bench/_work/venv-llmc: llm-compressor 0.14 (the reference of issues 17, 18 and 20); see setup_venv.sh.
exec "$(dirname "$0")/setup_venv.sh" llmc "llmcompressor==0.14.*" llmcompressor
