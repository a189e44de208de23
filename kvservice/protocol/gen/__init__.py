"""Generated protobuf and gRPC code: run ``make proto``, do not edit."""
