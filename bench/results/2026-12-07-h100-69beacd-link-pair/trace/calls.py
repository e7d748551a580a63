import json,sys,glob
fs=sorted(glob.glob(sys.argv[1]+'/*rank*.jsonl'))
R=[[json.loads(l) for l in open(f)][1:] for f in fs]
chunkb=int(sys.argv[2]) if len(sys.argv)>2 else 8<<20
for ci in range(len(R[0])):
    cs=[r[ci] for r in R]
    if not all(c.get('phases') for c in cs): continue
    bls=[{b['block']:b for b in c['phases']['blocks']} for c in cs]
    n=max(b for b in bls[0] if b<100)//2+1
    t0=min(min(b['start_ns'] for b in bl.values()) for bl in bls)
    first_ready=max(bl[0]['end_ns'] for bl in bls)-t0
    last_d2h=max(bl[2*(n-1)]['start_ns'] for bl in bls)-t0
    end=max(bl[2*(n-1)+1]['reduce_ns'] for bl in bls)-t0
    firstbar=[ (bl[126]['start_ns']-t0)/1e3 for bl in bls]
    k0=[(bl[0]['start_ns']-t0)/1e3 for bl in bls]
    tot=cs[0]['count']*2
    print('call',ci,'first barriers at',['%.0f'%x for x in firstbar],'k0 d2h done',['%.0f'%x for x in k0],'first ready %.0f last d2h %.0f end %.0f us -> busbw %.2f; d2h span rate %.1f GB/s (both ranks)'%(first_ready/1e3,last_d2h/1e3,end/1e3,tot/end,2*tot/(last_d2h-min(bl[126]['start_ns'] for bl in bls)+t0)))
