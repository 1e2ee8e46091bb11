"""A process's peak resident memory, as the memory tests measure it."""


def peak_mb() -> float:
    """This process's peak resident set (``VmHWM``) in MiB. Not ``ru_maxrss``: a process started
    from a big parent (pytest's) keeps the parent's high-water mark there after exec, so growth
    measured with it reads 0."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
