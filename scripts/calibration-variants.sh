# Sourced by scripts/device-calibration.sh and scripts/device-long-context.sh: the calibration
# arguments of each named variant, one table for every results row that names them.
# q-*: the QuantMLA rows; a-*: ablations (on INT2/INT4 g64, where both paths matter); x-*:
# extensions (extra bytes counted in the format); r-*: the 2-bit RoPE research rows (content left
# in BF16 so the RoPE key's own effect shows).
args_of() {
  case $1 in
    q-int4-g64) echo "--cache content=int4:g64,rope=int4:g64" ;;
    q-int4-g128) echo "--cache content=int4:g128,rope=int4:g64" ;;
    q-int2-g64) echo "--cache content=int2:g64,rope=int4:g64" ;;
    q-int2-g128) echo "--cache content=int2:g128,rope=int4:g64" ;;
    a-int2-rope-only) echo "--cache content=int2:g64,rope=int4:g64 --paths rope" ;;
    a-int2-content-only) echo "--cache content=int2:g64,rope=int4:g64 --paths content" ;;
    a-int2-rope-mse) echo "--cache content=int2:g64,rope=int4:g64 --rope-objective mse" ;;
    a-int2-content-mse) echo "--cache content=int2:g64,rope=int4:g64 --content-objective mse" ;;
    a-int4-rope-only) echo "--cache content=int4:g64,rope=int4:g64 --paths rope" ;;
    x-int4-g64-rope-g32) echo "--cache content=int4:g64,rope=int4:g32" ;;
    x-int4-g64-keep2) echo "--cache content=int4:g64,rope=int4:g64 --rope-bf16-pairs 2" ;;
    x-int2-g64-keep2) echo "--cache content=int2:g64,rope=int4:g64 --rope-bf16-pairs 2" ;;
    r-rope-int2-g64) echo "--cache content=bf16,rope=int2:g64 --paths rope" ;;
    r-rope-int2-g32) echo "--cache content=bf16,rope=int2:g32 --paths rope" ;;
    r-rope-int2-g64-keep2) echo "--cache content=bf16,rope=int2:g64 --paths rope --rope-bf16-pairs 2" ;;
    r-rope-int2-g32-keep2) echo "--cache content=bf16,rope=int2:g32 --paths rope --rope-bf16-pairs 2" ;;
    *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}
