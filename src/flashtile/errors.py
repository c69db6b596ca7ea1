"""The errors flashtile raises besides TypeError / ValueError / NotImplementedError for invalid arguments."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot serve this call (the message says why)."""


class KernelCompileError(RuntimeError):
    """Triton or ptxas could not compile a flashtile kernel for a launch, or its first launch failed: the message
    names the kernel, its tile and launch options and the grid, and the error it came from is chained
    (__cause__). Nothing was written to the outputs."""
