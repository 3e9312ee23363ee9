"""Tenants and what they are charged: client keys with their limits and fair shares
(``_tenants``), limits shared between edges in Valkey (``_cluster``, with the reply decoders in
``_cluster_replies``) and the edge's side of the usage ledger (``_ledger``).

docs/operations.md, "Tenants", says what each tenant can and cannot see of another.
"""
