#!/usr/bin/env bash
# An S3-compatible server for the tests of snapshots in S3 buckets (`ferry export -o s3://…`,
# test `capsule::a_snapshot_moves_through_an_s3_bucket`): moto's stand-alone server (PyPI
# `moto`, Apache-2.0), which checks AWS Signature Version 4 once asked to
# (`INITIAL_NO_AUTH_ACTION_COUNT`) and honours conditional writes. Installed into a virtual
# environment of its own, pinned by version, and only run by the tests (never as a service):
#   ${FERRY_TOOLS:-$HOME/.cache/ferry/tools}/moto/bin/moto_server
set -euo pipefail
tools="${FERRY_TOOLS:-$HOME/.cache/ferry/tools}"
venv="$tools/moto"
pins=("moto[s3]==5.2.5" "boto3==1.44.18" "botocore==1.44.18" "flask==3.1.3" "flask-cors==6.0.5")
stamp="$venv/.ferry-pins"
if [ -x "$venv/bin/moto_server" ] && [ "$(cat "$stamp" 2>/dev/null)" = "${pins[*]}" ]; then
    echo "moto: cached ($venv/bin/moto_server)"
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}"
echo "${pins[*]}" > "$stamp"
echo "moto: installed into $venv"
