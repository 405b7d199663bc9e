"""External-id revalidation of unresolved 404 cases and the operator's gate before a
replacement identity is used (docs/identity-revalidation.md)."""
