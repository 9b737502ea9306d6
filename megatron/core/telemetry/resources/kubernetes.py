"""Kubernetes pod attributes from the ``K8S_*`` variables (downward API), when running in a pod."""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

__all__ = ["detect_kubernetes_attributes"]

_KEYS = (
    ("k8s.namespace.name", "K8S_NAMESPACE"),
    ("k8s.pod.name", "K8S_POD_NAME"),
    ("k8s.pod.uid", "K8S_POD_UID"),
    ("k8s.node.name", "K8S_NODE_NAME"),
    ("k8s.container.name", "K8S_CONTAINER_NAME"),
    ("k8s.job.name", "K8S_JOB_NAME"),
)


def detect_kubernetes_attributes(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``k8s.*`` attributes; empty unless ``KUBERNETES_SERVICE_HOST`` is set.

    The pod name falls back to ``HOSTNAME``, which Kubernetes sets to the pod name.
    """
    env = os.environ if environ is None else environ
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return {}
    out = {key: env[var] for key, var in _KEYS if env.get(var)}
    if "k8s.pod.name" not in out and env.get("HOSTNAME"):
        out["k8s.pod.name"] = env["HOSTNAME"]
    return out
