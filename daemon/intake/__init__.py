"""Job intake: the watched inbox, and accepting (jobs/ID/) or rejecting (rejected/) a job file."""
