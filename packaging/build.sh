#!/usr/bin/env bash
# Builds dist/vkvagent_<version>_all.deb and dist/vkvagent-<version>-1.noarch.rpm (`make package`).
#
# One nfpm configuration (packaging/nfpm.yaml) packs, for both formats, a tree staged here in
# build/package/: vkvagent and its pure-Python runtime dependencies installed by uv for
# Python 3.9 (markers evaluated for the oldest target, so tomli and friends are in) into one
# version-independent directory, /usr/lib/vkvagent, that Python 3.9 to 3.13 all import.
# Environment: PYTHON, UV, NFPM (default: the dev venv's), SOURCE_DATE_EPOCH (default: the
# last commit's time), VKVAGENT_MAINTAINER, VKVAGENT_VERSION (default: vkvagent.__version__).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
UV=${UV:-.venv/bin/uv}
NFPM=${NFPM:-.venv/bin/nfpm}
stage=build/package

# VKVAGENT_VERSION overrides the package's version (the upgrade tests build a newer one).
version=${VKVAGENT_VERSION:-$(PYTHONPATH=. "$PYTHON" -c 'import vkvagent; print(vkvagent.__version__)')}
if [[ -z ${SOURCE_DATE_EPOCH:-} ]]; then
    SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || date +%s)
fi
export SOURCE_DATE_EPOCH VKVAGENT_VERSION=$version
export VKVAGENT_MAINTAINER=${VKVAGENT_MAINTAINER:-"vkvagent maintainers <vkvagent@users.noreply.github.com>"}

rm -rf "$stage"
mkdir -p "$stage/share" dist

# The vendored tree: no scripts (the launcher is ours), no build paths, no compiled code.
"$UV" pip install --quiet --no-progress --target "$stage/lib" --python-version 3.9 \
    --python-platform linux --no-compile .
rm -rf "$stage/lib/bin" "$stage/lib/.lock" "$stage/lib/example.py"  # example.py: nvidia-ml-py's
find "$stage/lib" -name direct_url.json -delete
find "$stage/lib" -name __pycache__ -type d -prune -exec rm -rf {} +
# Modules are imported, never run: a "#!" line in a file that is not executable only
# confuses lintian and rpmlint.
grep -rlZ --include='*.py' '^#!' "$stage/lib" | xargs -0 -r sed -i '1{/^#!/d}'
chmod -R u=rwX,go=rX "$stage/lib"
compiled=$(find "$stage/lib" -type f \( -name '*.so' -o -name '*.so.*' -o -name '*.pyd' \))
if [[ -n $compiled ]]; then
    echo "build.sh: compiled code in the vendored tree (it must stay version-independent):" >&2
    echo "$compiled" >&2
    exit 1
fi

# /etc/vkvagent/config.toml: every key with its default, commented out, except the policy
# mode, shown set to its default (observe: never restarts) so enabling restarts is one edit.
PYTHONPATH=. "$PYTHON" - "$stage/config.toml" <<'EOF'
import re
import sys

from vkvagent.knowledge import config, toml_schema

lines = [
    "# vkvagent's configuration. Each key is shown with its default; uncomment to change it.",
    "# Files in /etc/vkvagent/conf.d/*.toml are read after this one (later files win, key by",
    "# key). Check your edits with `vkvagent config check`, then `systemctl reload vkvagent`.",
    "",
]
section = ""
for line in toml_schema.render(config.Config(), with_docs=True).splitlines():
    header = re.match(r"\[(.+)\]$", line)
    if header:
        section = header.group(1)
    elif re.match(r"[A-Za-z0-9_-]+ = ", line) and (section, line) != ("policy", 'mode = "observe"'):
        line = "# " + line
    lines.append(line)
text = "\n".join(lines) + "\n"
if 'mode = "observe"' not in text:
    sys.exit("build.sh: the rendered config has no policy mode = \"observe\"")
with open(sys.argv[1], "w", encoding="utf-8") as handle:
    handle.write(text)
EOF
# The shipped file must mean exactly the built-in defaults.
PYTHONPATH=. "$PYTHON" -c 'import sys; from pathlib import Path; from vkvagent.knowledge import config
sys.exit(config.load(Path(sys.argv[1]), as_root=False) != config.Config())' "$stage/config.toml"

# Shell completion, generated from the command's own parser so it names every option.
mkdir -p "$stage/completion"
"$PYTHON" tools/completion.py bash >"$stage/completion/vkvagent"
"$PYTHON" tools/completion.py zsh >"$stage/completion/_vkvagent"

gzip -9n <packaging/vkvagent.8 >"$stage/vkvagent.8.gz"
gzip -9n <CHANGELOG.md >"$stage/changelog.gz"
# The packages' own changelog, which nfpm writes as changelog.Debian.gz and as the rpm's
# %changelog; the project's CHANGELOG.md is shipped as changelog.gz.
cat >"$stage/changelog.yml" <<END
- semver: $version-1
  date: $(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
  packager: $VKVAGENT_MAINTAINER
  deb:
    urgency: medium
    distributions: [unstable]
  changes:
    - note: vkvagent $version; see /usr/share/doc/vkvagent/changelog.gz.
END
cp -r packaging/prometheus "$stage/share/prometheus"
rm -rf "$stage/share/prometheus/tests"
cp -r packaging/grafana "$stage/share/grafana"
cp -r packaging/siem "$stage/share/siem"  # tests/test_siem.py runs these very files
find "$stage" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

"$NFPM" package --config packaging/nfpm.yaml --packager deb --target "dist/vkvagent_${version}_all.deb" >/dev/null
"$NFPM" package --config packaging/nfpm.yaml --packager rpm --target "dist/vkvagent-${version}-1.noarch.rpm" >/dev/null
ls -l "dist/vkvagent_${version}_all.deb" "dist/vkvagent-${version}-1.noarch.rpm"
