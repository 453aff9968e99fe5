"""The data plane: frames on the wire, pipeline stages, part servers, emulated nodes."""
