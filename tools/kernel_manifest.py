"""Writes the sha256 of every generated kernel source (CUDA for sm_90a and AscendC) at the lowering cases.

    python tools/kernel_manifest.py OUT.json [--backend cuda|ascend] [--family FAMILY]
    python tools/kernel_manifest.py --compare BEFORE.json AFTER.json
    python tools/kernel_manifest.py BEFORE.json --normalize RENAMES.json   (run on the sources before a rename)

A refactoring that must not move performance or numerics keeps every hash: ``--compare`` lists the kernels
whose source changed, appeared or went away (matched by backend, family, hidden size and case name, and
failing that by the source hash alone, so that renamed cases with unchanged sources are reported as renames).
A rename of identifiers is checked by hashing the sources before it with ``--normalize``, a JSON file
``{"substrings": {old: new}, "words": {old: new}}`` applied to each source first: the manifest after the rename
must then equal it.
"""

import argparse
import hashlib
import importlib
import json
import re
import sys

from cann_ops_tilelang import limits
from cann_ops_tilelang._library import registered_families

# the families of the registered ops, each at the hidden sizes that matter as limits.py declares them
# (<FAMILY>_HIDDEN_SIZES): the committed docs/perf/kernel_sources.json holds exactly these
HIDDEN = {family: limits.hidden_sizes(family)[2] for family in registered_families()}


def source_of(backend: str, prim_func) -> str:
    if backend == "cuda":
        from cann_ops_tilelang.kernels.cuda import _build

        return _build.lower_source(prim_func, arch="sm_90a")
    from cann_ops_tilelang.kernels.ascend import _build

    return _build.lower_ascendc(prim_func).source


def normalizer(renames: dict):
    """The source text with the renames applied: substrings first, then whole identifiers."""
    subs, words = renames.get("substrings", {}), renames.get("words", {})
    sub_re = re.compile("|".join(map(re.escape, sorted(subs, key=len, reverse=True)))) if subs else None
    # an old identifier alone or as the prefix of one the code generator derives from it (x_grad_local_cast)
    word_re = re.compile(r"\b(" + "|".join(map(re.escape, sorted(words, key=len, reverse=True))) + r")(?=\b|_)") \
        if words else None

    def apply(text: str) -> str:
        if sub_re:
            text = sub_re.sub(lambda m: subs[m.group(0)], text)
        if word_re:
            text = word_re.sub(lambda m: words[m.group(1)], text)
        return text

    return apply


def manifest(backends, families, normalize=lambda text: text) -> dict:
    out = {}
    for backend in backends:
        for family in families:
            module = importlib.import_module(f"cann_ops_tilelang.kernels.{backend}.{family}")
            for hidden in HIDDEN[family]:
                for case, prim_func in sorted(module.lowering_cases(hidden).items()):
                    digest = hashlib.sha256(normalize(source_of(backend, prim_func)).encode()).hexdigest()
                    out[f"{backend}/{family}/H{hidden}/{case}"] = digest
                    print(f"{backend}/{family}/H{hidden}/{case} {digest[:16]}", file=sys.stderr, flush=True)
    return out


def _where(key: str) -> str:
    """backend/family/H of a manifest key (the case name after it may change in a refactoring)."""
    return "/".join(key.split("/")[:3])


def compare(before: dict, after: dict) -> int:
    by_hash = {}
    for key, digest in after.items():
        by_hash.setdefault(digest, []).append(key)
    changed = 0
    for key, digest in sorted(before.items()):
        if after.get(key) == digest:
            continue
        same = [k for k in by_hash.get(digest, []) if _where(k) == _where(key)]
        if same:
            print(f"renamed   {key} -> {', '.join(same)}")
        elif key in after:
            print(f"CHANGED   {key}")
            changed += 1
        else:
            print(f"GONE      {key}")
            changed += 1
    for key in sorted(set(after) - set(before)):
        if after[key] not in before.values():
            print(f"NEW       {key}")
    print(f"{len(before)} kernels before, {len(after)} after, {changed} changed or gone")
    return 1 if changed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--backend", choices=("cuda", "ascend"), action="append")
    parser.add_argument("--family", choices=tuple(HIDDEN), action="append")
    parser.add_argument("--normalize", metavar="RENAMES.json", help="apply these renames to each source first")
    args = parser.parse_args()
    if len(args.paths) != (2 if args.compare else 1):
        parser.error("expected OUT.json, or --compare BEFORE.json AFTER.json (one path to write, two to compare)")
    if args.compare:
        manifests = []
        for path in args.paths:
            try:
                with open(path) as f:
                    manifests.append(json.load(f))
            except (OSError, ValueError) as exc:
                parser.error(f"cannot read the manifest {path}: {exc}")
        return compare(*manifests)
    normalize = lambda text: text  # noqa: E731
    if args.normalize:
        with open(args.normalize) as f:
            normalize = normalizer(json.load(f))
    result = manifest(args.backend or ("cuda", "ascend"), args.family or tuple(HIDDEN), normalize)
    with open(args.paths[0], "w") as f:
        json.dump(result, f, indent=0, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
