"""What this machine can run and which profile it serves: hardware (NVML), the manifests, planning."""
