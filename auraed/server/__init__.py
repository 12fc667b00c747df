"""The gRPC server: listeners, mTLS, authorization and the mapping of errors to status codes."""
