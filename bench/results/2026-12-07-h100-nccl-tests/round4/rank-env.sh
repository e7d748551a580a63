#!/bin/sh
export NCCL_HOSTID=nccltests-rank$OMPI_COMM_WORLD_RANK
exec "$@"
