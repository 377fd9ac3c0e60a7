"""Kubernetes NetworkPolicy semantics, evaluated offline over rendered policies: may this pod (or
address) open that pod's port? Used by tests/test_k8s.py (every overlay's flows under a default-deny
namespace) and tests/test_k8s_monitoring.py (Prometheus to the trainers' /metrics)::

    policies = [DEFAULT_DENY, *rendered_network_policies]
    pod = {"ns": "elastic-trainer", "labels": {...}}        # a pod; {"ip": "203.0.113.9"} outside the cluster
    allowed(policies, src=pod, dst=other_pod, port=29500)   # both sides' policies must allow it
"""

from __future__ import annotations

import ipaddress

# A namespace whose default is deny, as many clusters set it up; the tests add it to the rendered ones.
DEFAULT_DENY = {"kind": "NetworkPolicy", "metadata": {"name": "default-deny", "namespace": "elastic-trainer"},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}}


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (``matchLabels`` only) selects ``labels``."""
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and \
        not selector.get("matchExpressions")


def peer_matches(peer: dict, policy_ns: str, end: dict) -> bool:
    """Does a NetworkPolicy peer (podSelector / namespaceSelector / ipBlock) match ``end``
    (``{"ns", "labels"}`` for a pod, ``{"ip"}`` for an address outside the cluster)?"""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        return "ip" in end and ipaddress.ip_address(end["ip"]) in ipaddress.ip_network(block["cidr"]) and \
            not any(ipaddress.ip_address(end["ip"]) in ipaddress.ip_network(c) for c in block.get("except", []))
    if "ip" in end:
        return False
    if "namespaceSelector" in peer:
        ns_ok = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": end["ns"]})
    else:
        ns_ok = end["ns"] == policy_ns
    return ns_ok and selects(peer.get("podSelector", {}), end["labels"])


def rule_matches(rule: dict, peers_key: str, policy_ns: str, other: dict, port: int, proto: str) -> bool:
    peers = rule.get(peers_key)
    ports = rule.get("ports")
    peer_ok = not peers or any(peer_matches(p, policy_ns, other) for p in peers)
    port_ok = not ports or any(p.get("protocol", "TCP") == proto and
                               (p.get("port") is None or p["port"] <= port <= p.get("endPort", p["port"]))
                               for p in ports)
    return peer_ok and port_ok


def allowed(policies: list[dict], src: dict, dst: dict, port: int, proto: str = "TCP") -> bool:
    """Whether Kubernetes NetworkPolicy semantics let ``src`` open ``dst``:``port``."""
    def side(end, kind, rules_key, peers_key, other):
        if "ip" in end:
            return True  # outside the cluster: no policy of ours applies
        selecting = [p for p in policies if p["metadata"]["namespace"] == end["ns"]
                     and selects(p["spec"]["podSelector"], end["labels"]) and kind in p["spec"]["policyTypes"]]
        return not selecting or any(rule_matches(r, peers_key, p["metadata"]["namespace"], other, port, proto)
                                    for p in selecting for r in p["spec"].get(rules_key, []))
    return side(src, "Egress", "egress", "to", dst) and side(dst, "Ingress", "ingress", "from", src)
