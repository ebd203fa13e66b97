"""Policies: the pydantic policy model, its YAML loader, resolution for one request, and hot reload."""

from policies.loader import PolicyError, PolicyIssue, load_policy, parse_policy
from policies.model import Policy, Tenant, hash_api_key
from policies.resolve import PolicyDenied, ResolvedPolicy
from policies.watch import PolicyHolder, ReloadResult

__all__ = [
    "Policy", "PolicyDenied", "PolicyError", "PolicyHolder", "PolicyIssue", "ReloadResult", "ResolvedPolicy",
    "Tenant", "hash_api_key", "load_policy", "parse_policy",
]
