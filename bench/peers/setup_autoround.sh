#!/usr/bin/env bash
# bench/_work/venv-autoround: auto-round 0.16 (the SignRound peer of issue 20); see setup_venv.sh.
exec "$(dirname "$0")/setup_venv.sh" autoround "auto-round==0.16.*" auto_round
