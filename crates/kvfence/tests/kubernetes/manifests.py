"""Validates rendered Kubernetes manifests and prints them as JSON.

Reads `kubectl kustomize` output on stdin. Every object of a built-in kind
is validated, strictly (no unknown fields), against the API schemas that
the pinned `kubernetes-validate` bundles for the Kubernetes version given
as the first argument; objects of the custom resources kvfence's
manifests use (the Gateway API, its Inference Extension, cert-manager) have
no bundled schema and are listed as such on stderr. Prints
{"objects": [...], "unvalidated": [...]} on stdout; exits 1 on the first
invalid object, naming it and the error.
"""

import json
import sys

import kubernetes_validate
import yaml

CUSTOM_GROUPS = ("gateway.networking.k8s.io", "inference.networking.k8s.io", "cert-manager.io")


def main() -> int:
    version = sys.argv[1]
    objects = [doc for doc in yaml.safe_load_all(sys.stdin) if doc]
    unvalidated = []
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if obj.get("apiVersion", "").split("/")[0] in CUSTOM_GROUPS:
            unvalidated.append(name)
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            print(f"{name} is invalid: {error.message} at {list(error.path)}", file=sys.stderr)
            return 1
        except kubernetes_validate.SchemaNotFoundError as error:
            print(f"{name}: no schema ({error})", file=sys.stderr)
            return 1
    json.dump({"objects": objects, "unvalidated": unvalidated}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
