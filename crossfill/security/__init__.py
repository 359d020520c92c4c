"""Security: tenants and API keys, mutual TLS, transfer tickets, KV encryption at rest, audit, abuse limits."""
